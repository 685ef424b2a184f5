"""FP8 linears against a float64 reference of quantize -> matrix product -> dequantize, written here from the
formulas (Transformer Engine's scale fp8_max / amax / 2^margin, saturating casts), for every recipe and format:
the forward product and both gradients, at TP=1 (tests/multiprocess/test_tensor_parallel_layers.py: TP=2)."""

from __future__ import annotations

import pytest
import torch

from megalite.tensor_parallel import fp8 as fp8_numerics
from megalite.tensor_parallel import fp8_linear as fp8_linears
from megalite.tensor_parallel.fp8 import E4M3, E5M2, Fp8Recipe, quantized_matmul, scaled_mm
from megalite.tensor_parallel.fp8_linear import Fp8History, fp8_linear, update_delayed_scales

from .fp8_reference import reference

pytestmark = pytest.mark.usefixtures("single_process_layout")

def _operands(dtype=torch.float32, tokens=48, inputs=64, outputs=32):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, inputs, generator=gen) * torch.linspace(0.1, 3, inputs)).to(dtype)   # uneven columns
    w = (torch.randn(outputs, inputs, generator=gen) * 0.02).to(dtype)
    g = (torch.randn(tokens, outputs, generator=gen) * torch.linspace(1e-4, 1e-3, tokens)[:, None]).to(dtype)
    return x, w, g


def _run(x, w, g, recipe: Fp8Recipe, history=None, kind="column"):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(x, w, recipe, history, kind)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def _close(got, want, rtol):
    """Each result within ``rtol`` of the reference's largest magnitude (the products' output rounding)."""
    error = (got.double() - want).abs().max() / want.abs().max()
    assert error <= rtol, f"relative error {error:.2e} > {rtol:.0e}"
    return float(error)


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_linear_matches_the_float64_reference(recipe, fmt):
    """fp32 activations: the products accumulate in fp32, so what is left is fp32 rounding; the FP8 error itself (vs
    the unquantized product) is orders larger, which shows the quantization took place. The delayed recipe's first
    step scales tensorwise."""
    x, w, g = _operands()
    history = Fp8History(Fp8Recipe(fmt, recipe)) if recipe == "delayed" else None
    got = _run(x, w, g, Fp8Recipe(fmt, recipe), history)
    want = reference(x, w, g, "rowwise" if recipe == "rowwise" else "tensorwise", fmt)
    exact = (x.double() @ w.double().t(), g.double() @ w.double(), g.double().t() @ x.double())
    for name, a, b, c in zip(("y", "dx", "dW"), got, want, exact):
        _close(a, b, 1e-5)
        assert (b - c).abs().max() / c.abs().max() > 1e-3, f"{name}: no FP8 error at all"


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_linear_in_bf16(recipe, fmt):
    """bf16 activations and weights (what training uses): the reference within bf16's rounding of the output."""
    x, w, g = _operands(torch.bfloat16)
    got = _run(x, w, g, Fp8Recipe(fmt, recipe), Fp8History(Fp8Recipe(fmt, recipe)) if recipe == "delayed" else None)
    want = reference(x, w, g, "rowwise" if recipe == "rowwise" else "tensorwise", fmt)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        _close(a, b, 2 ** -7)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scales_come_from_the_history(algo):
    """After two steps with different amaxes the third scales by max(history) or the most recent amax, whatever
    the tensor's own amax now (values above it saturate); the running amaxes of the step are recorded."""
    recipe = Fp8Recipe("hybrid", "delayed", amax_history_len=4, amax_compute_algo=algo, margin=1)
    history = Fp8History(recipe)
    x, w, g = _operands()
    big, small = (x.abs().max(), w.abs().max(), g.abs().max()), None
    history.running = torch.stack([v.float() for v in big])
    update_delayed_scales([("linear", history)], [])
    small = tuple(v * 0.5 for v in big)
    history.running = torch.stack([v.float() for v in small])
    update_delayed_scales([("linear", history)], [])
    assert history.steps == 2 and torch.equal(history.history[:, 0], torch.stack(small).float())
    got = _run(x, w, g, recipe, history)
    amaxes = big if algo == "max" else small
    want = reference(x, w, g, "tensorwise", "hybrid", amaxes=amaxes, margin=1)
    for a, b in zip(got, want):
        _close(a, b, 1e-5)
    assert torch.allclose(history.running, torch.stack(big).float())   # this step's own amaxes, for the next


def test_history_saves_and_loads_bit_for_bit():
    recipe = Fp8Recipe("e4m3", "delayed", amax_history_len=3)
    history = Fp8History(recipe)
    for step in range(4):
        history.running = torch.rand(3, generator=torch.Generator().manual_seed(step))
        history.push(history.running)
    other = Fp8History(recipe)
    other.load_state_dict(history.state_dict())
    assert other.steps == 4 and torch.equal(other.history, history.history) and torch.equal(other.scales,
                                                                                            history.scales)
    with pytest.raises(ValueError, match="history-len"):
        Fp8History(Fp8Recipe("e4m3", "delayed", amax_history_len=2)).load_state_dict(history.state_dict())


@pytest.mark.parametrize("a_dtype, b_dtype", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_product_and_its_dequantized_fallback_agree(recipe, a_dtype, b_dtype, monkeypatch):
    """torch._scaled_mm (where this torch has it on CPU) and the dequantized fp32 product it falls back to give the
    same numbers; a failing kernel is taken over by the fallback."""
    a, b = torch.randn(32, 64), torch.randn(64, 48)
    kernel = quantized_matmul(a, b, a_dtype, b_dtype, recipe)

    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel")
    monkeypatch.setattr(fp8_numerics, "_backends", {})
    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with pytest.warns(RuntimeWarning, match="torch._scaled_mm refused"):
        fallback = quantized_matmul(a, b, a_dtype, b_dtype, recipe)
    assert torch.allclose(kernel, fallback, rtol=1e-5, atol=1e-5)
    assert set(fp8_numerics.backends().values()) == {"dequantized fp32"}


def test_a_refused_kind_of_product_warns_once_with_the_reason(monkeypatch):
    """The first refusal of a kind of product (device, dtypes, scaling) warns, naming the kind and the kernel's
    reason (its first line); the later ones of that kind run the fallback quietly, another kind warns again."""
    def refuse(*args, **kwargs):
        raise RuntimeError("no FP8 kernel for these operands\nlong details")
    monkeypatch.setattr(fp8_numerics, "_backends", {})
    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    a, b = torch.randn(32, 64), torch.randn(64, 48)
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(3):
            quantized_matmul(a, b, E4M3, E4M3)
        quantized_matmul(a, b, E5M2, E4M3)
        quantized_matmul(a, b, E4M3, E4M3, "rowwise")
    messages = [str(w.message) for w in caught if "_scaled_mm" in str(w.message)]
    assert len(messages) == 3, messages
    assert "cpu float8_e4m3fn float8_e4m3fn tensorwise (no FP8 kernel for these operands)" in messages[0]
    assert "long details" not in messages[0]
    assert "float8_e5m2 float8_e4m3fn tensorwise" in messages[1] and "rowwise" in messages[2]


def _fp8_operands(m=32, k=64, n=48, device="cpu"):
    """FP8 a [m, k] row-major, b [k, n] column-major, tensorwise fp32 scales."""
    a = torch.zeros(m, k, device=device).to(E4M3)
    b = torch.zeros(n, k, device=device).to(E4M3).t()
    return a, b, torch.ones((), device=device), torch.ones((), device=device)


@pytest.mark.parametrize("breach, match", [
    (lambda a, b, sa, sb: (a.t().contiguous().t(), b, sa, sb, torch.bfloat16), "first operand must be row-major"),
    (lambda a, b, sa, sb: (a, b.contiguous(), sa, sb, torch.bfloat16), "second operand must be column-major"),
    (lambda a, b, sa, sb: (a[:, :40].contiguous(), b[:40], sa, sb, torch.bfloat16), "K=40"),
    (lambda a, b, sa, sb: (a, b[:, :40], sa, sb, torch.bfloat16), "N=40"),
    (lambda a, b, sa, sb: (a, b, sa.double(), sb, torch.bfloat16), "scales must be fp32"),
    (lambda a, b, sa, sb: (a, b, torch.ones(32), torch.ones(48), torch.bfloat16), r"\[M, 1\] and \[1, N\]"),
    (lambda a, b, sa, sb: (a, b, torch.ones(32, 1), torch.ones(48, 1), torch.bfloat16), r"\[M, 1\] and \[1, N\]"),
    (lambda a, b, sa, sb: (a, b, sa, sb, torch.float16), "bf16 or fp32"),
    (lambda a, b, sa, sb: (a, b[:32], sa, sb, torch.bfloat16), "2-D matrices"),
])
def test_scaled_mm_contract_check_names_each_breach(breach, match):
    a, b, sa, sb = _fp8_operands()
    fp8_numerics.check_scaled_mm_operands(a, b, sa, sb, torch.bfloat16)   # the contract kept
    fp8_numerics.check_scaled_mm_operands(a, b, torch.ones(32, 1), torch.ones(1, 48), torch.float32)   # rowwise
    fp8_numerics.check_scaled_mm_operands(a[:5], b, sa, sb, torch.bfloat16)   # M is free
    with pytest.raises(ValueError, match="torch._scaled_mm contract broken: .*" + match):
        fp8_numerics.check_scaled_mm_operands(*breach(a, b, sa, sb))


def test_a_wrongly_laid_out_operand_is_caught_off_cpu(monkeypatch):
    """A planted defect: the layout step hands the kernel a row-major second operand. On ``meta`` (CUDA's
    contracts without a GPU) the check raises, instead of the kernel's refusal being taken for a missing kernel
    and every later product falling back; on CPU, whose kernel takes any layout, the product still runs."""
    monkeypatch.setattr(fp8_numerics, "_backends", {})
    monkeypatch.setattr(fp8_numerics, "_kernel_layout", lambda a, b: (a.contiguous(), b.contiguous()))
    a, b = torch.randn(32, 64, device="meta"), torch.randn(64, 48, device="meta")
    with pytest.raises(ValueError, match="second operand must be column-major"):
        quantized_matmul(a, b, E4M3, E4M3)
    assert quantized_matmul(torch.randn(32, 64), torch.randn(64, 48), E4M3, E4M3).shape == (32, 48)


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_linear_runs_on_meta_tensors_through_the_kernel(recipe, kind, monkeypatch):
    """The FP8 linear's forward and backward on ``meta`` tensors (a simulation of a CUDA run) go through
    torch._scaled_mm with every contract kept and read no value on the host; the delayed recipe also after its
    first step, scaling from the history."""
    monkeypatch.setattr(fp8_numerics, "_backends", {})
    fp8 = Fp8Recipe("hybrid", recipe)
    history = Fp8History(fp8).to(torch.device("meta")) if recipe == "delayed" else None
    for step in range(2 if recipe == "delayed" else 1):
        x = torch.empty(2, 16, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(48, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        y = fp8_linear(x, w, fp8, history, kind)
        y.backward(torch.empty_like(y))
        assert y.shape == (2, 16, 48) and x.grad.shape == x.shape and w.grad.shape == w.shape
        if history is not None:
            update_delayed_scales([("linear", history)], [])
    assert set(fp8_numerics.backends().values()) == {"torch._scaled_mm"}, fp8_numerics.backends()


def test_saturating_cast_and_margin():
    x = torch.tensor([1.0, -2.0, 8.0])
    q = scaled_mm(fp8_numerics.quantize(x[None], torch.tensor(64.0), E4M3), torch.ones(3, 1).to(E4M3),
                  torch.tensor(0.5), torch.tensor(1.0), torch.float32)
    assert q.item() == (64 - 128 + 448) * 0.5   # 512 saturates at e4m3's 448 instead of becoming NaN
    assert fp8_numerics.scale_from_amax(torch.tensor(448.0), E4M3, margin=2).item() == 0.25


def _count_weight_quantizations(monkeypatch, weight) -> list[torch.dtype]:
    """The dtypes ``weight`` is quantized to from now on, one entry a quantization."""
    quantized, original = [], fp8_linears.quantize

    def counting(x, scale, dtype):
        if x is weight:
            quantized.append(dtype)
        return original(x, scale, dtype)
    monkeypatch.setattr(fp8_linears, "quantize", counting)
    return quantized


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_a_weight_is_quantized_once_for_all_micro_batches_of_a_step(recipe, monkeypatch):
    """Four micro-batches (forward and backward) of a step quantize the weight once (rowwise: once per layout, as
    the forward and the input gradient scale it per row and per column), with the same results as quantizing it
    each time; an update of the weight (its version), and for the delayed recipe the history's new scales, make
    the next micro-batch quantize it afresh."""
    fp8 = Fp8Recipe("hybrid", recipe)
    x, w, g = _operands(torch.bfloat16)
    w = w.clone().requires_grad_()
    layouts = 2 if recipe == "rowwise" else 1
    runs = {}
    for cache in (False, True):
        history = Fp8History(fp8) if recipe == "delayed" else None
        weight = w.detach().clone().requires_grad_()
        quantized = _count_weight_quantizations(monkeypatch, weight)
        results, counts = [], []
        for step in range(3):
            for micro_batch in range(4):
                xm = (x * (micro_batch + 1)).requires_grad_()
                y = fp8_linear(xm, weight, fp8, history, "column", cache_weight=cache)
                y.backward(g)
                results += [y.detach(), xm.grad]
            counts.append(len(quantized))
            results.append(weight.grad)
            weight.grad = None
            if history is not None:
                update_delayed_scales([("linear", history)], [])
            if step == 0:
                with torch.no_grad():
                    weight.mul_(0.5)   # the optimizer's update
            # step 1 -> 2: the weight is unchanged (a skipped step): only the delayed scales change
        runs[cache] = results
        if cache:
            assert counts == [layouts, 2 * layouts, 2 * layouts + (recipe == "delayed")], counts
        else:
            assert counts == [4 * layouts, 8 * layouts, 12 * layouts]
        if history is not None:
            runs[cache].append(history.history)
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True]))
