"""The fused kernels prove themselves before use: before training (megalite.kernels.prepare), every kernel function
(forward and backward) runs on random inputs, in fp32, bf16 and fp16, at odd and small realistic shapes, against its
specification in :mod:`torch_ops` on the same inputs. A fused op one of whose kernels is outside the bound on any
rank is switched off on every rank: its calls run as torch ops, and rank 0 names the kernel and the error seen
(:mod:`megalite.kernels.agreement`); ``--use-fused-kernels on`` makes such a failure an error
(:class:`KernelSelfCheckFailed`) instead.

Error: max |kernel - specification| / max |specification| over each output (a NaN or inf never passes); bounds 1e-4
in fp32 and 2e-2 in bf16/fp16 (the specification computes in fp32 as the kernels do, so the two differ by rounding
only; a wrong index or formula is off by O(1)). ``tools/gpu_check.py`` measures the kernels tighter, against float64.

The verdict (which ops failed, and why) is kept per process and in ``<extensions dir>/megalite_fused/self_check.json``
keyed by device name, torch version and a hash of the extension's sources, so a run on a device already checked with
the same build reads it instead of checking again. The inputs come from a generator of the check's own: the model's
random streams are untouched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import types
from typing import Callable

import torch

from megalite.extensions import CSRC_DIR, ExtensionUnavailable, extensions_dir
from megalite.kernels import torch_ops

BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CACHE_FILE = "self_check.json"


class KernelSelfCheckFailed(ExtensionUnavailable):
    """With ``--use-fused-kernels on``, a fused kernel disagreed with its specification on this device."""


@dataclasses.dataclass(frozen=True)
class Probe:
    """One kernel function at one shape: ``make(dtype, generator, device)`` gives its arguments."""
    op: str          # the policy's op name (megalite.kernels.policy.OPS) the function belongs to
    function: str    # the name in the extension and in torch_ops
    shape: str
    make: Callable[[torch.dtype, torch.Generator, torch.device], tuple]


def _randn(shape, dtype, generator, device, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=generator, device=device) * scale + shift).to(dtype)


def _probes() -> list[Probe]:
    """Odd sizes (rows and columns that fill no warp or block evenly) and one or two modest realistic ones."""
    probes = []

    def add(op, function, shape, make):
        probes.append(Probe(op, function, "x".join(map(str, shape)), make))

    for shape in [(3, 37, 37), (2, 130, 130)]:
        def softmax_y(dtype, g, device, shape=shape):
            return torch_ops.masked_softmax_forward(_randn(shape, dtype, g, device, scale=4.0), 0.125)
        add("masked_softmax", "masked_softmax_forward", shape,
            lambda dtype, g, device, shape=shape: (_randn(shape, dtype, g, device, scale=4.0), 0.125))
        add("masked_softmax", "masked_softmax_backward", shape,
            lambda dtype, g, device, shape=shape, y=softmax_y: (_randn(shape, dtype, g, device),
                                                                y(dtype, g, device), 0.125))
    for shape in [(3, 7, 333), (64, 1024)]:
        for tanh in (False, True):
            add("bias_gelu", "bias_gelu_forward", shape,
                lambda dtype, g, device, shape=shape, tanh=tanh: (
                    _randn(shape, dtype, g, device, scale=2.0), _randn(shape[-1:], dtype, g, device), tanh))
            add("bias_gelu", "bias_gelu_backward", shape,
                lambda dtype, g, device, shape=shape, tanh=tanh: (
                    _randn(shape, dtype, g, device), _randn(shape, dtype, g, device, scale=2.0),
                    _randn(shape[-1:], dtype, g, device), tanh))
    for shape in [(5, 3, 333), (37, 1000), (8, 4096)]:
        def norm_inputs(dtype, g, device, shape=shape):
            return (_randn(shape, dtype, g, device, scale=2.0, shift=1.0), _randn(shape[-1:], dtype, g, device, shift=1.0),
                    _randn(shape[-1:], dtype, g, device))

        def layer_norm_backward(dtype, g, device, inputs=norm_inputs, shape=shape):
            x, w, b = inputs(dtype, g, device)
            _, mean, rstd = torch_ops.layer_norm_forward(x, w, b, 1e-5)
            return _randn(shape, dtype, g, device), x, w, mean, rstd

        def rms_norm_backward(dtype, g, device, inputs=norm_inputs, shape=shape):
            x, w, _ = inputs(dtype, g, device)
            _, rstd = torch_ops.rms_norm_forward(x, w, 1e-5)
            return _randn(shape, dtype, g, device), x, w, rstd

        add("layernorm", "layer_norm_forward", shape, lambda dtype, g, device, i=norm_inputs: (*i(dtype, g, device), 1e-5))
        add("layernorm", "layer_norm_backward", shape, layer_norm_backward)
        add("layernorm", "rms_norm_forward", shape,
            lambda dtype, g, device, i=norm_inputs: (*i(dtype, g, device)[:2], 1e-5))
        add("layernorm", "rms_norm_backward", shape, rms_norm_backward)
    for batch, seq, heads, dim in [(2, 19, 3, 16), (1, 128, 4, 64)]:
        def rope_inputs(dtype, g, device, shape=(batch, seq, heads, dim)):
            # [batch, seq, heads, dim] viewed [batch, heads, seq, dim], as the model hands queries and keys over.
            angles = torch.arange(shape[1], device=device, dtype=torch.float32)[:, None] * torch.rand(
                shape[3] // 2, generator=g, device=device)
            angles = torch.cat([angles, angles], dim=-1)
            return _randn(shape, dtype, g, device).transpose(1, 2), angles.cos(), angles.sin()
        add("rope", "rope_forward", (batch, heads, seq, dim), rope_inputs)
        add("rope", "rope_backward", (batch, heads, seq, dim), rope_inputs)
    for rows, cols, valid in [(37, 333, 300), (16, 4096, 4096)]:
        def ce_inputs(dtype, g, device, rows=rows, cols=cols, valid=valid):
            logits = _randn((rows, cols), dtype, g, device, scale=3.0)
            # Targets before, inside and after this shard, as under tensor parallelism.
            target = torch.randint(-cols, 2 * cols, (rows,), generator=g, device=device)
            return logits, target, valid

        def ce_grad(dtype, g, device, inputs=ce_inputs, rows=rows):
            logits, target, valid = inputs(dtype, g, device)
            row_max, sum_exp, _ = torch_ops.cross_entropy_stats(logits, target, valid)
            return logits, target, row_max, sum_exp, torch.rand(rows, generator=g, device=device), valid
        add("cross_entropy", "cross_entropy_stats", (rows, cols), ce_inputs)
        add("cross_entropy", "cross_entropy_grad", (rows, cols), ce_grad)
    return probes


def relative_error(ours, reference) -> float:
    """The largest error over the outputs (a tuple or one tensor): max |ours - ref| / max |ref|, inf for NaN/inf."""
    if isinstance(reference, torch.Tensor):
        ours, reference = (ours,), (reference,)
    worst = 0.0
    for a, b in zip(ours, reference, strict=True):
        if a.shape != b.shape or not torch.isfinite(a).all():
            return math.inf
        b = b.double()
        finite = torch.isfinite(b)   # the cross entropy's max of an all-padding row is -inf in both
        if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a.double()[~finite], b[~finite]):
            return math.inf
        scale = b[finite].abs().max().item() if finite.any() else 0.0
        error = (a.double() - b)[finite].abs().max().item() if finite.any() else 0.0
        worst = max(worst, error / (scale if scale > 0 else 1.0))
    return worst


def run_self_check(extension: types.ModuleType, device: torch.device, seed: int = 0) -> dict[str, str]:
    """Run every probe on ``device`` through ``extension``; returns {op: why} for the ops that failed (empty: all
    passed). A kernel that raises fails too, with its exception as the reason."""
    poison = getattr(extension, "set_poison_outputs", None)   # the extension's outputs start as NaN: an element
    if poison is not None:                                     # a kernel leaves unwritten cannot pass
        poison(True)
    try:
        return _run_probes(extension, device, seed)
    finally:
        if poison is not None:
            poison(False)


def _run_probes(extension: types.ModuleType, device: torch.device, seed: int) -> dict[str, str]:
    failures: dict[str, str] = {}
    generator = torch.Generator(device=device)
    for probe in _probes():
        if probe.op in failures:
            continue
        for dtype in DTYPES:
            generator.manual_seed(seed)
            with torch.no_grad():
                args = probe.make(dtype, generator, device)
                try:
                    ours = getattr(extension, probe.function)(*args)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                except Exception as error:   # a launch failure, a refused shape: the kernel cannot be used
                    failures[probe.op] = (f"{probe.function} {_name(dtype)} {probe.shape} raised "
                                          f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
                    break
                error = relative_error(ours, getattr(torch_ops, probe.function)(*args))
            if not error <= BOUNDS[dtype]:
                failures[probe.op] = (f"{probe.function} {_name(dtype)} {probe.shape}: error {error:.2e} > bound "
                                      f"{BOUNDS[dtype]:.0e}")
                break
    return failures


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def sources_hash(sources: list[str]) -> str:
    """sha256 over the extension's sources and every header beside them (what a rebuild would change)."""
    digest = hashlib.sha256()
    paths = {CSRC_DIR / s for s in sources} | set((CSRC_DIR / "cuda").glob("*.h*"))
    for path in sorted(paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes() if path.is_file() else b"missing")
    return digest.hexdigest()[:16]


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


_verdicts: dict[tuple[int, str], dict[str, str]] = {}   # (id of the extension, device) -> failures, this process


def failed_ops(extension: types.ModuleType, device: torch.device, name: str, sources: list[str]) -> dict[str, str]:
    """{op: why} of the ops whose kernels failed on ``device``: checked on the first call for a device (or read from
    the cache file), then remembered for the process."""
    memo = (id(extension), str(device))
    if memo not in _verdicts:
        key = f"{device_name(device)} | torch {torch.__version__} | sources {sources_hash(sources)}"
        path = extensions_dir() / name / CACHE_FILE
        cached = _read(path)
        if key not in cached:
            cached[key] = run_self_check(extension, device)
            _write(path, {**_read(path), key: cached[key]})   # re-read: another rank may have written meanwhile
        _verdicts[memo] = cached[key]
    return _verdicts[memo]


def refuse(failures: dict[str, str], device: torch.device) -> KernelSelfCheckFailed:
    return KernelSelfCheckFailed(
        f"fused kernels failed their self-check on {device_name(device)} (--use-fused-kernels auto would run them "
        f"as torch ops): " + "; ".join(f"{op}: {why}" for op, why in failures.items()))


def _read(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path, verdicts: dict) -> None:
    """Atomically (a temporary file renamed over the old one); a cache that cannot be written only costs a recheck."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(verdicts, indent=1, sort_keys=True))
        os.replace(temporary, path)
    except OSError:
        pass
