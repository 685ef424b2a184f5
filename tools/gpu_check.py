"""Check megalite's fused CUDA kernels on one GPU, time them, and measure bf16 training throughput; a table comes last.

    python tools/gpu_check.py                       # on a machine with one NVIDIA GPU, after pip install -e .
    python tools/gpu_check.py --peak-tflops 989     # a GPU whose bf16 peak is not in megalite/model/flops.py

1. Build: the extension (csrc/fused_ops.cpp + csrc/cuda/*.cu, sm_80 and sm_90) through the same JIT path as training,
   and the self-check training runs before it uses the kernels (megalite/kernels/self_check.py), its verdict printed.
2. Correctness: every kernel, forward and backward, in fp32, bf16 and fp16, on fresh random inputs (the seed is
   printed; --seed repeats a run) at odd and realistic shapes, against the plain torch composition in float64. The
   kernels' outputs are filled with NaN before they run (set_poison_outputs), so an unwritten element fails. Error:
   max |ours - reference| / max |reference| per output and per gradient; bounds fp32 1e-5, bf16 and fp16 1e-2; a NaN
   or inf never passes.
3. Speed, bf16 at hidden 4096 and sequence 4096 (one sequence; 32 heads of 128): each kernel against eager torch
   (the same function as plain torch ops) and torch.compile of it, forward and backward (CUDA events, mean of
   --iters calls after warm-up); apex / Transformer Engine norms too when importable; and the attention core, SDPA
   against q k^T + fused softmax + v, which is why --use-fused-kernels auto keeps SDPA.
4. Training: GPT 1.3B (configs/model/gpt_1_3b.yaml) in bf16 through megalite's Trainer on mock data, a few
   iterations with the fused kernels (auto) and with torch ops (off): time per iteration, tokens/s, TFLOP/s and MFU,
   the trainer's model FLOPs per iteration (megalite/model/flops.py: 72 B L s h^2 (1 + s/(6h) + V/(12 h L)) for
   these GPT shapes, Korthikanti et al. 2022) over the measured time and the GPU's dense bf16 peak.
5. FP8 (megalite/tensor_parallel/fp8*.py): every recipe (tensorwise, delayed, rowwise) and format (e4m3, hybrid) of
   the FP8 linear, forward and both gradients, through torch._scaled_mm against the same quantized operands
   multiplied dequantized in fp32 (bound 1e-2: bf16 outputs), with the path each product took (a product the GPU's
   kernel refuses falls back, and says so); speed of a 4096 x 4096 linear over 4096 tokens, bf16 against each FP8
   recipe, forward / backward; and the GPT 1.3B training step with --fp8-format hybrid (delayed and tensorwise)
   beside the bf16 rows (the same model FLOPs, so its MFU is against the bf16 peak).

Meant to finish within 8 minutes on one H200 (the extension build, 1-2 minutes, and torch.compile's compilations
dominate: once --compile-budget seconds have passed, the remaining compilations are skipped). Exit code 0 when every
check passed, 1 when one failed, 2 when there is no GPU (or the extension cannot be built). ``--cpu-dry-run`` runs
the same steps on CPU with the kernels' torch ops (megalite/kernels/torch_ops.py), tiny shapes and a tiny model, for
the CPU tests of this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megalite import parallel_state  # noqa: E402
from megalite.kernels import fused, self_check, torch_ops  # noqa: E402
from megalite.extensions import ExtensionUnavailable  # noqa: E402
from megalite.kernels.policy import KernelPolicy, fused_extension  # noqa: E402
from megalite.kernels.agreement import prepare  # noqa: E402
from megalite.model.flops import model_flops_per_iteration, peak_bf16_tflops  # noqa: E402
from megalite.model.rotary import RotaryEmbedding, rotate_half  # noqa: E402
from megalite.tensor_parallel.cross_entropy import fused_vocab_parallel_cross_entropy  # noqa: E402
from megalite.tensor_parallel import fp8 as fp8_numerics  # noqa: E402
from megalite.tensor_parallel.fp8 import Fp8Recipe  # noqa: E402
from megalite.tensor_parallel.fp8_linear import Fp8History, fp8_linear  # noqa: E402

BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
EPS = 1e-5


# ---------------------------------------------------------------------------------------------------------- cases
# A case is one op at one shape: random inputs, "ours" (the fused autograd function on the given ops) and the plain
# torch composition that defines it (run in float64 for the reference, in the input dtype for the speed rows).

@dataclasses.dataclass
class Case:
    op: str
    shape: str
    make_inputs: Callable[[torch.dtype, torch.device], list[torch.Tensor]]   # the first ones require grad
    ours: Callable[..., torch.Tensor]        # (ops, *inputs) -> output
    reference: Callable[..., torch.Tensor]   # (*inputs) -> output, plain torch ops in the inputs' dtype
    grad_inputs: int                         # how many leading inputs get gradients


def _randn(shape, dtype, device, scale=1.0, shift=0.0):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale + shift).to(dtype)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 for the half types, as the kernels compute; float64 stays float64 (the reference)."""
    return x if x.dtype == torch.float64 else x.float()


def _causal_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    mask = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
    return torch.softmax((_wide(x) * scale).masked_fill(mask, float("-inf")), dim=-1).to(x.dtype)


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    wide = _wide(x)
    return (wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + EPS) * _wide(w)).to(x.dtype)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy(_wide(logits[..., :vocab]), target, reduction="none")


def cases(sizes: str) -> list[Case]:
    """``sizes``: "check" (odd and medium shapes for correctness), "speed" (hidden 4096, sequence 4096, bf16) or
    "tiny" (the CPU dry run)."""
    if sizes == "speed":
        b, s, heads, d, ffn, vocab, padded = 1, 4096, 32, 128, 16384, 50257, 50304
        softmax_shapes, norm_shapes, gelu_shapes, rope_shapes, ce_shapes = (
            [(b * heads, s, s)], [(b * s, heads * d)], [(b * s, ffn)], [(b, s, heads, d)], [(b * s, padded, vocab)])
    elif sizes == "check":
        softmax_shapes = [(6, 257, 257), (2, 2048, 2048)]
        norm_shapes = [(2, 333, 1000), (4096, 4096), (7, 12288)]
        gelu_shapes = [(2, 333, 3000), (2048, 16384)]
        rope_shapes = [(2, 129, 4, 64), (1, 4096, 32, 128)]
        ce_shapes = [(333, 3000, 2900), (2048, 50304, 50257)]
    else:
        softmax_shapes, norm_shapes, gelu_shapes, rope_shapes, ce_shapes = (
            [(3, 17, 17)], [(5, 48)], [(5, 40)], [(2, 9, 3, 16)], [(7, 64, 60)])
    result = []
    for shape in softmax_shapes:
        scale = 1.0 / math.sqrt(128)
        result.append(Case(
            "masked softmax", "x".join(map(str, shape)),
            lambda dtype, device, shape=shape: [_randn(shape, dtype, device, scale=8.0)],
            lambda ops, x, scale=scale: fused.scaled_masked_softmax(x, scale, ops),
            lambda x, scale=scale: _causal_softmax(x, scale), 1))
    for shape in gelu_shapes:
        for name, tanh in (("bias + GeLU", False), ("bias + tanh GeLU", True)):   # exact, --openai-gelu
            result.append(Case(
                name, "x".join(map(str, shape)),
                lambda dtype, device, shape=shape: [_randn(shape, dtype, device, scale=2.0),
                                                    _randn(shape[-1:], dtype, device)],
                lambda ops, x, bias, tanh=tanh: fused.bias_gelu(x, bias, ops, tanh=tanh),
                lambda x, bias, tanh=tanh: F.gelu(x + bias, approximate="tanh" if tanh else "none"), 2))
    for shape in norm_shapes:
        result.append(Case(
            "LayerNorm", "x".join(map(str, shape)),
            lambda dtype, device, shape=shape: [_randn(shape, dtype, device, scale=2.0, shift=1.0),
                                                _randn(shape[-1:], dtype, device, shift=1.0),
                                                _randn(shape[-1:], dtype, device)],
            lambda ops, x, w, b: fused.layer_norm(x, w, b, EPS, ops),
            lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS), 3))
        result.append(Case(
            "RMSNorm", "x".join(map(str, shape)),
            lambda dtype, device, shape=shape: [_randn(shape, dtype, device, scale=2.0),
                                                _randn(shape[-1:], dtype, device, shift=1.0)],
            lambda ops, x, w: fused.rms_norm(x, w, EPS, ops), _rms_norm, 2))
    for batch, seq, heads, dim in rope_shapes:
        # Queries as the model has them: [batch, seq, heads, dim] from the QKV projection, viewed [b, h, s, d].
        def make(dtype, device, shape=(batch, seq, heads, dim)):
            cos, sin = RotaryEmbedding(shape[-1], 10000).cos_sin(shape[1], device)
            return [_randn(shape, dtype, device), cos, sin]

        result.append(Case(
            "rotary", f"{batch}x{heads}x{seq}x{dim}", make,
            lambda ops, x, cos, sin: fused.rotary(x.transpose(1, 2), cos, sin, ops),
            lambda x, cos, sin: (x.transpose(1, 2) * cos.to(x.dtype) + rotate_half(x.transpose(1, 2))
                                 * sin.to(x.dtype)), 1))
    for rows, cols, vocab in ce_shapes:
        def make(dtype, device, rows=rows, cols=cols, vocab=vocab):
            return [_randn((rows, cols), dtype, device, scale=3.0),
                    torch.randint(vocab, (rows,), device=device)]

        result.append(Case(
            "cross entropy", f"{rows}x{cols} (vocab {vocab})", make,
            lambda ops, logits, target, vocab=vocab: fused_vocab_parallel_cross_entropy(logits, target, vocab, ops),
            lambda logits, target, vocab=vocab: _cross_entropy(logits, target, vocab), 1))
    return result


# ---------------------------------------------------------------------------------------------------- correctness

@dataclasses.dataclass
class CheckRow:
    op: str
    dtype: str
    shape: str
    forward_error: float
    backward_error: float
    bound: float

    @property
    def passed(self) -> bool:   # NaN compares False: it never passes
        return self.forward_error <= self.bound and self.backward_error <= self.bound


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference|; inf if ours holds a NaN or inf (the reference never does)."""
    if not torch.isfinite(ours).all():
        return float("inf")
    scale = reference.abs().max().item()
    return (ours.double() - reference).abs().max().item() / (scale if scale > 0 else 1.0)


def check_case(case: Case, ops, dtype: torch.dtype, device: torch.device) -> CheckRow:
    inputs = case.make_inputs(dtype, device)
    n = case.grad_inputs
    ours_in = [t.detach().clone().requires_grad_(i < n) for i, t in enumerate(inputs)]
    reference_in = [t.detach().double().requires_grad_(i < n) if t.is_floating_point() else t
                    for i, t in enumerate(inputs)]
    ours = case.ours(ops, *ours_in)
    reference = case.reference(*reference_in)
    grad_out = torch.randn(reference.shape, dtype=torch.float64, device=device)
    ours_grads = torch.autograd.grad(ours, ours_in[:n], grad_out.to(ours.dtype))
    # The reference's gradient is taken at the same rounded grad_output the kernels see.
    reference_grads = torch.autograd.grad(reference, reference_in[:n], grad_out.to(ours.dtype).double())
    backward = max(relative_error(g, r) for g, r in zip(ours_grads, reference_grads, strict=True))
    return CheckRow(case.op, DTYPE_NAMES[dtype], case.shape, relative_error(ours, reference), backward,
                    BOUNDS[dtype])


def check_cross_entropy_targets_elsewhere(ops, device: torch.device) -> CheckRow:
    """The per-shard statistics where targets fall before and after this rank's slice (target logit 0) and where
    the slice is all padding (max -inf, sum 0): the cases only tensor parallelism reaches."""
    logits = _randn((64, 1000), torch.bfloat16, device, scale=3.0)
    target = torch.randint(-2000, 3000, (64,), device=device)
    row_max, sum_exp, target_logit = ops.cross_entropy_stats(logits, target, 900)
    x = logits.double()[:, :900]
    ref_max = x.max(dim=-1).values
    ref_sum = (x - ref_max[:, None]).exp().sum(dim=-1)
    here = (target >= 0) & (target < 1000)
    ref_target = torch.where(here, logits.double().gather(-1, target.clamp(0, 999)[:, None])[:, 0], 0.0)
    error = max(relative_error(row_max, ref_max), relative_error(sum_exp, ref_sum),
                relative_error(target_logit, ref_target))
    empty_max, empty_sum, _ = ops.cross_entropy_stats(logits, target, 0)
    if not (torch.all(empty_max == float("-inf")) and torch.all(empty_sum == 0)):
        error = float("inf")
    return CheckRow("cross entropy, other ranks' targets / padding", "bf16", "64x1000", error, 0.0,
                    BOUNDS[torch.bfloat16])


# ---------------------------------------------------------------------------------------------------------- speed

@dataclasses.dataclass
class SpeedRow:
    op: str
    shape: str
    times: dict[str, tuple[float, float] | str]   # implementation -> (forward ms, backward ms) or why not


class Timer:
    def __init__(self, device: torch.device, iters: int):
        self.device, self.iters = device, iters

    def __call__(self, fn: Callable[[], object]) -> float:
        """Mean milliseconds per call of ``fn`` after two warm-up calls."""
        for _ in range(2):
            fn()
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(self.iters):
                fn()
            return (time.perf_counter() - start) * 1000.0 / self.iters
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.iters


def time_forward_backward(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], n: int,
                          timer: Timer) -> tuple[float, float]:
    """(forward ms, backward ms): the forward with autograd recording, then forward + backward minus forward."""
    grad_inputs = inputs[:n]
    output = fn(*inputs)
    grad = torch.randn_like(output)
    forward = timer(lambda: fn(*inputs))
    both = timer(lambda: torch.autograd.grad(fn(*inputs), grad_inputs, grad))
    return forward, max(both - forward, 0.0)


def speed_rows(ops, device: torch.device, timer: Timer, compile_deadline: float, sizes: str,
               log: Callable[[str], None]) -> list[SpeedRow]:
    rows = []
    dtype = torch.bfloat16
    for case in cases(sizes):
        inputs = [t.requires_grad_(i < case.grad_inputs) if t.is_floating_point() else t
                  for i, t in enumerate(case.make_inputs(dtype, device))]
        times: dict[str, tuple[float, float] | str] = {}
        implementations = [("fused", lambda *xs, case=case: case.ours(ops, *xs)), ("eager", case.reference)]
        implementations.append(("compile", None))
        for name, fn in implementations:
            if name == "compile":
                if device.type != "cuda":
                    times[name] = "skipped (CPU dry run)"
                    continue
                if time.monotonic() > compile_deadline:
                    times[name] = "skipped (--compile-budget spent)"
                    continue
                try:
                    fn = torch.compile(case.reference)
                    started = time.monotonic()
                    output = fn(*inputs)   # compiles the forward, then the backward
                    torch.autograd.grad(output, inputs[:case.grad_inputs], torch.ones_like(output))
                    del output
                    log(f"  compiled {case.op} in {time.monotonic() - started:.0f} s")
                except Exception as error:   # an op inductor cannot compile, a missing Triton, ...
                    times[name] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}"
                    continue
            try:
                times[name] = time_forward_backward(fn, inputs, case.grad_inputs, timer)
            except torch.OutOfMemoryError:
                times[name] = "out of memory"
                torch.cuda.empty_cache()
        rows.append(SpeedRow(case.op, case.shape, times))
        log(f"  {case.op} {case.shape}: " + ", ".join(
            f"{name} {_format_times(t)}" for name, t in times.items()))
        rows.extend(external_norm_rows(case, inputs, timer))
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows.append(attention_core_row(ops, device, timer, sizes))
    return rows


def external_norm_rows(case: Case, inputs: list[torch.Tensor], timer: Timer) -> list[SpeedRow]:
    """Apex's and Transformer Engine's LayerNorm/RMSNorm on the same input, when importable (never required)."""
    if case.op not in ("LayerNorm", "RMSNorm") or not inputs[0].is_cuda:
        return []
    hidden = inputs[0].shape[-1]
    candidates = []
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm
        candidates.append(("apex", FusedLayerNorm if case.op == "LayerNorm" else FusedRMSNorm))
    except Exception:
        pass
    try:
        import transformer_engine.pytorch as te
        candidates.append(("transformer engine", te.LayerNorm if case.op == "LayerNorm" else te.RMSNorm))
    except Exception:
        pass
    rows = []
    for name, module_class in candidates:
        try:
            module = module_class(hidden, eps=EPS).to(device=inputs[0].device, dtype=inputs[0].dtype)
            times = {name: time_forward_backward(lambda x: module(x), inputs[:1], 1, timer)}
        except Exception as error:
            times = {name: f"failed: {type(error).__name__}"}
        rows.append(SpeedRow(case.op, case.shape, times))
    return rows


def attention_core_row(ops, device: torch.device, timer: Timer, sizes: str) -> SpeedRow:
    """softmax(q k^T / sqrt(d) + causal) v: SDPA against the fused-softmax core of --use-fused-kernels on."""
    b, heads, s, d = (1, 32, 4096, 128) if sizes == "speed" else (1, 4, 64, 16) if sizes == "tiny" else (1, 8, 1024, 64)
    q, k, v = (_randn((b, heads, s, d), torch.bfloat16, device).requires_grad_() for _ in range(3))

    def unfused(q, k, v):
        return fused.scaled_masked_softmax(q @ k.transpose(-2, -1), 1.0 / math.sqrt(d), ops) @ v

    times = {}
    for name, fn in [("SDPA", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                     ("fused softmax", unfused)]:
        try:
            times[name] = time_forward_backward(fn, [q, k, v], 3, timer)
        except torch.OutOfMemoryError:
            times[name] = "out of memory"
    return SpeedRow("attention core", f"{b}x{heads}x{s}x{d}", times)


# ------------------------------------------------------------------------------------------------------- training

@dataclasses.dataclass
class TrainRow:
    model: str
    policy: str
    ms_per_iteration: float
    tokens_per_s: float
    tflops: float
    mfu: float | None
    losses: list[float]


def train_rows(args, device: torch.device, peak_tflops: float | None, log: Callable[[str], None]) -> list[TrainRow]:
    from megalite.config.cli import parse_args
    from megalite.config import validate
    from megalite.training import Trainer, initialize_distributed, shutdown_distributed

    model = "model=gpt_tiny" if args.cpu_dry_run else "model=gpt_1_3b"
    argv = [model, "--mock-data", "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size",
            str(args.global_batch_size), "--train-iters", "1000", "--eval-interval", "0", "--log-interval", "1",
            "--lr", "1e-4", "--lr-warmup-iters", "10"]
    if not args.cpu_dry_run:
        argv.append("--bf16")
    cfg = parse_args(argv)
    validate(cfg, 1)
    parallel_state.destroy_model_parallel()
    device = initialize_distributed(cfg.parallel)
    rows = []
    try:
        started = time.monotonic()
        trainer = Trainer.on_registered_layout(cfg, device)
        log(f"  built {trainer.describe()} in {time.monotonic() - started:.0f} s")
        m, t = trainer.cfg.model, trainer.cfg.training
        description = (f"{model.split('=')[1]} ({m.num_layers} layers, hidden {m.hidden_size}, sequence "
                       f"{m.seq_length}, {t.global_batch_size} sequences per iteration, "
                       f"{'bf16' if t.bf16 else 'fp32'})")
        flops = model_flops_per_iteration(m, t.global_batch_size)
        fused_policy = prepare(KernelPolicy("auto"), device)   # built and self-checked, as training does
        runs = [("fused kernels (auto)", fused_policy, None), ("torch ops (off)", KernelPolicy("off"), None)]
        if not args.skip_fp8:
            runs += [(f"FP8 hybrid {recipe}, fused kernels", fused_policy, recipe)
                     for recipe in ("delayed", "tensorwise")]
        for name, policy, fp8_recipe in runs:
            if fp8_recipe is not None:   # a fresh trainer with the FP8 linears (the bf16 one's memory freed first)
                del trainer
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                fp8_cfg = parse_args(argv + ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", fp8_recipe])
                validate(fp8_cfg, 1)
                trainer = Trainer.on_registered_layout(fp8_cfg, device)
            # The Trainer built its model with its options' policy (auto); the modules that read one are switched here.
            for module in trainer.model.modules():
                if hasattr(module, "kernels"):
                    module.kernels = policy
            losses = [trainer.train_step()["loss"] for _ in range(args.warmup_iters)]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            losses += [trainer.train_step()["loss"] for _ in range(args.train_iters)]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = (time.perf_counter() - start) / args.train_iters
            tflops = flops / seconds / 1e12
            rows.append(TrainRow(description, name, seconds * 1000.0, t.global_batch_size * m.seq_length / seconds,
                                 tflops, tflops / peak_tflops if peak_tflops else None, losses))
            log(f"  {name}: {seconds * 1000:.0f} ms/iteration, {tflops:.0f} TFLOP/s, losses "
                + " ".join(f"{loss:.3f}" for loss in losses))
    finally:
        shutdown_distributed()
    return rows


# ------------------------------------------------------------------------------------------------------------ FP8

FP8_RECIPES = ("tensorwise", "delayed", "rowwise")


def _fp8_run(recipe: Fp8Recipe, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor):
    """(y, dx, dW) of the FP8 linear (one process); delayed: its second step, scaled from the first's history."""
    history = Fp8History(recipe) if recipe.recipe == "delayed" else None
    for _ in range(2 if history is not None else 1):
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = fp8_linear(xi, wi, recipe, history, "column")
        y.backward(g)
        if history is not None:
            history.push(history.running)
    return y.detach(), xi.grad, wi.grad


def fp8_checks(device: torch.device, sizes: str) -> list[CheckRow]:
    """Each recipe and format through torch._scaled_mm against the dequantized fp32 products of the same FP8
    operands; the row names the path the products took."""
    tokens, inputs, outputs = (64, 64, 48) if sizes == "tiny" else (1024, 1024, 768)
    x = _randn((tokens, inputs), torch.bfloat16, device)
    w = _randn((outputs, inputs), torch.bfloat16, device, scale=0.02)
    g = _randn((tokens, outputs), torch.bfloat16, device, scale=1e-3)
    rows = []
    for name in FP8_RECIPES:
        for fmt in ("e4m3", "hybrid"):
            recipe = Fp8Recipe(fmt, name)
            fp8_numerics._backends.clear()
            ours = _fp8_run(recipe, x, w, g)
            paths = sorted(set(fp8_numerics.backends().values()))
            for key in list(fp8_numerics._backends):
                fp8_numerics._backends[key] = "dequantized fp32"
            reference = _fp8_run(recipe, x, w, g)
            fp8_numerics._backends.clear()
            errors = [relative_error(a, b) for a, b in zip(ours, reference)]
            rows.append(CheckRow(f"FP8 linear {name} ({', '.join(paths)})", fmt, f"{tokens}x{inputs}x{outputs}",
                                 errors[0], max(errors[1:]), 1e-2))
    return rows


@dataclasses.dataclass
class Fp8SpeedRow:
    recipe: str
    shape: str
    bf16: tuple[float, float]
    fp8: tuple[float, float]
    path: str


def fp8_speed_rows(device: torch.device, timer: Timer, sizes: str) -> list[Fp8SpeedRow]:
    """A linear's forward / backward in bf16 and in each FP8 recipe (hybrid): quantization included."""
    tokens, hidden = (64, 64) if sizes == "tiny" else (4096, 4096)
    x = _randn((tokens, hidden), torch.bfloat16, device).requires_grad_()
    w = _randn((hidden, hidden), torch.bfloat16, device, scale=0.02).requires_grad_()
    bf16 = time_forward_backward(F.linear, [x, w], 2, timer)
    rows = []
    for name in FP8_RECIPES:
        recipe = Fp8Recipe("hybrid", name)
        history = Fp8History(recipe) if name == "delayed" else None
        fp8_numerics._backends.clear()
        fp8 = time_forward_backward(lambda a, b: fp8_linear(a, b, recipe, history, "column"), [x, w], 2, timer)
        if history is not None:   # timed with the history's scales: no amax pass in the products' way
            history.push(history.running)
            fp8 = time_forward_backward(lambda a, b: fp8_linear(a, b, recipe, history, "column"), [x, w], 2, timer)
        rows.append(Fp8SpeedRow(name, f"{tokens}x{hidden}x{hidden}", bf16, fp8,
                                ", ".join(sorted(set(fp8_numerics.backends().values())))))
    return rows


# ---------------------------------------------------------------------------------------------------------- table

def _format_times(t: tuple[float, float] | str) -> str:
    return t if isinstance(t, str) else f"{t[0]:.3f} / {t[1]:.3f} ms"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    line = "+".join("-" * (w + 2) for w in widths)
    fmt = lambda cells: "|".join(f" {str(c):<{w}} " for c, w in zip(cells, widths))   # noqa: E731
    return "\n".join([fmt(header), line, *(fmt(r) for r in rows)])


def report(build: list[str], checks: list[CheckRow], speeds: list[SpeedRow], training: list[TrainRow],
           peak_tflops: float | None, fp8_speeds: list[Fp8SpeedRow] = ()) -> str:
    parts = ["", "=" * 30 + " gpu_check summary " + "=" * 30, *build, ""]
    parts.append(_table(["check", "dtype", "shape", "forward err", "backward err", "bound", "result"],
                        [[c.op, c.dtype, c.shape, f"{c.forward_error:.2e}", f"{c.backward_error:.2e}",
                          f"{c.bound:.0e}", "PASS" if c.passed else "FAIL"] for c in checks]))
    if speeds:
        parts += ["", "speed, bf16, forward / backward ms (speed-up of fused over eager and compile, forward+backward)"]
        table_rows = []
        for row in speeds:
            fused_time = row.times.get("fused")
            for name, t in row.times.items():
                speedup = ""
                if name != "fused" and isinstance(t, tuple) and isinstance(fused_time, tuple):
                    speedup = f"{sum(t) / max(sum(fused_time), 1e-9):.2f}x"
                table_rows.append([row.op, row.shape, name, _format_times(t), speedup])
        parts.append(_table(["op", "shape", "implementation", "forward / backward", "fused speed-up"], table_rows))
    if fp8_speeds:
        parts += ["", "speed, FP8 hybrid linear against bf16, forward / backward ms (quantization included)"]
        parts.append(_table(["recipe", "shape", "bf16", "FP8", "FP8 speed-up", "products"],
                            [[r.recipe, r.shape, _format_times(r.bf16), _format_times(r.fp8),
                              f"{sum(r.bf16) / max(sum(r.fp8), 1e-9):.2f}x", r.path] for r in fp8_speeds]))
    if training:
        peak = f"{peak_tflops:g} TFLOP/s bf16 peak" if peak_tflops else "unknown peak (--peak-tflops): no MFU"
        parts += ["", f"training {training[0].model} ({peak})"]
        parts.append(_table(["kernels", "ms / iteration", "tokens / s", "TFLOP/s", "MFU", "final loss"],
                            [[r.policy, f"{r.ms_per_iteration:.1f}", f"{r.tokens_per_s:.0f}", f"{r.tflops:.1f}",
                              f"{r.mfu:.1%}" if r.mfu is not None else "n/a", f"{r.losses[-1]:.4f}"]
                             for r in training]))
    failed = sum(not c.passed for c in checks)
    bad_training = [r.policy for r in training if not all(math.isfinite(x) for x in r.losses)]
    verdict = (f"{len(checks) - failed}/{len(checks)} kernel checks passed"
               + (f"; non-finite training loss with {', '.join(bad_training)}" if bad_training else ""))
    parts += ["", ("PASS: " if not failed and not bad_training else "FAIL: ") + verdict]
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------------------- main

def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-tflops", type=float, help="The GPU's dense bf16 peak (default: from its name).")
    parser.add_argument("--seed", type=int, help="Seed of the random inputs (default: a fresh one, printed).")
    parser.add_argument("--iters", type=int, default=20, help="Timed calls per kernel measurement.")
    parser.add_argument("--compile-budget", type=float, default=270.0,
                        help="Seconds after the start past which torch.compile comparisons are skipped.")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="Training: sequences per micro-batch.")
    parser.add_argument("--global-batch-size", type=int, default=16, help="Training: sequences per iteration.")
    parser.add_argument("--warmup-iters", type=int, default=2, help="Training: untimed iterations per policy.")
    parser.add_argument("--train-iters", type=int, default=5, help="Training: timed iterations per policy.")
    parser.add_argument("--skip-speed", action="store_true", help="Only check correctness (and train).")
    parser.add_argument("--skip-training", action="store_true", help="No training run.")
    parser.add_argument("--skip-fp8", action="store_true", help="No FP8 checks, speeds or training runs.")
    parser.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:5.0f} s] {message}", flush=True)

    if args.cpu_dry_run:
        device, ops, peak, sizes = torch.device("cpu"), torch_ops, args.peak_tflops, "tiny"
        build = ["CPU dry run: the kernels' torch ops (megalite/kernels/torch_ops.py), no extension, tiny shapes"]
        args.micro_batch_size, args.global_batch_size = 2, 4
    else:
        if not torch.cuda.is_available():
            print(f"gpu_check: no CUDA device is visible (torch {torch.__version__}, built for CUDA "
                  f"{torch.version.cuda or 'none: a CPU build'}); run it on a machine with an NVIDIA GPU",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
        peak = args.peak_tflops or peak_bf16_tflops(name)
        log(f"{name}, torch {torch.__version__} (CUDA {torch.version.cuda}); building the fused extension ...")
        try:
            ops = fused_extension(required=True)
        except ExtensionUnavailable as error:
            print(f"gpu_check: {error}", file=sys.stderr)
            return 2
        build_s = time.monotonic() - started
        build = [f"device: {name}, capability sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}, "
                 f"torch {torch.__version__}, CUDA {torch.version.cuda}",
                 f"extension: built or loaded in {build_s:.1f} s from {Path(ops.__file__).parent} (sm_80 + sm_90)"]
        log(build[-1])
        ops.set_poison_outputs(True)
        sizes = "check"
    failures = self_check.run_self_check(ops, device)   # what training runs before it uses the kernels
    build.append("self-check (as training runs it): " + ("every kernel passed" if not failures else "; ".join(
        f"{op} FAILED, runs as torch ops: {why}" for op, why in failures.items())))
    log(build[-1])
    if device.type == "cuda":
        ops.set_poison_outputs(True)   # the self-check leaves it off
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    build.append(f"inputs: seed {seed} (--seed {seed} repeats them)")
    parallel_state.initialize_model_parallel(1, 1)   # the cross entropy reads the (trivial) TP layout

    checks = []
    for case in cases(sizes):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            try:
                checks.append(check_case(case, ops, dtype, device))
            except Exception as error:   # a launch failure or a shape the binding refuses: a failed check
                traceback.print_exc()
                checks.append(CheckRow(f"{case.op} ({type(error).__name__})", DTYPE_NAMES[dtype], case.shape,
                                       float("nan"), float("nan"), BOUNDS[dtype]))
            row = checks[-1]
            if not row.passed:
                log(f"  FAIL {row.op} {row.dtype} {row.shape}: forward {row.forward_error:.2e}, backward "
                    f"{row.backward_error:.2e} (bound {row.bound:.0e})")
    checks.append(check_cross_entropy_targets_elsewhere(ops, device))
    if not args.skip_fp8:
        checks += fp8_checks(device, "tiny" if args.cpu_dry_run else "check")
    log(f"correctness: {sum(c.passed for c in checks)}/{len(checks)} checks passed")
    if device.type == "cuda":
        ops.set_poison_outputs(False)   # timings without the extra fills
        torch.cuda.synchronize(device)

    speeds: list[SpeedRow] = []
    if not args.skip_speed:
        log("speed ...")
        speeds = speed_rows(ops, device, Timer(device, args.iters), started + args.compile_budget,
                            "tiny" if args.cpu_dry_run else "speed", log)
    fp8_speeds: list[Fp8SpeedRow] = []
    if not args.skip_speed and not args.skip_fp8:
        fp8_speeds = fp8_speed_rows(device, Timer(device, args.iters), "tiny" if args.cpu_dry_run else "speed")
        log("FP8 speed: " + ", ".join(f"{r.recipe} {sum(r.bf16) / max(sum(r.fp8), 1e-9):.2f}x" for r in fp8_speeds))
    parallel_state.destroy_model_parallel()

    training: list[TrainRow] = []
    if not args.skip_training:
        log("training ...")
        try:
            training = train_rows(args, device, peak, log)
        except torch.OutOfMemoryError:
            build.append(f"training: out of memory at micro-batch size {args.micro_batch_size}: retry with "
                         f"--micro-batch-size {max(args.micro_batch_size // 2, 1)}")

    print(report(build, checks, speeds, training, peak, fp8_speeds), flush=True)
    ok = all(c.passed for c in checks) and all(math.isfinite(x) for r in training for x in r.losses)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
