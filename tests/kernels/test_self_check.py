"""The fused kernels' self-check, on CPU with stand-in extensions: correct kernels (the torch ops) stay on, a wrong
one (off everywhere, off only at odd sizes, off only in bf16, or raising) is switched off with one line naming it
and the error under ``auto``, and stops the run under ``on``; the verdict is cached per device name, torch version
and source hash."""

from __future__ import annotations

import json
import types

import pytest
import torch

from megalite.kernels import policy, self_check, torch_ops
from megalite.kernels.agreement import resolve
from megalite.kernels.policy import OPS, KernelPolicy
from megalite.kernels.self_check import KernelSelfCheckFailed, run_self_check

from ..helpers import fake_fused_extension

CPU = torch.device("cpu")
FAKE_CUDA = types.SimpleNamespace(is_cuda=True, device=CPU)   # a "CUDA" tensor whose kernels run on the CPU

pytestmark = pytest.mark.usefixtures("fresh_extension_cache")   # tests/conftest.py


def _forgets_the_weight(x, weight, eps):
    return torch_ops.rms_norm_forward(x, torch.ones_like(weight), eps)


def _drops_the_last_column_when_odd(x, bias, tanh=False):   # a tail loop that is never run
    y = torch_ops.bias_gelu_forward(x, bias, tanh)
    if x.shape[-1] % 32:
        y[..., -1] = 0
    return y


def _bf16_rounds_twice(grad_y, cos, sin):   # wrong in the half types only
    y = torch_ops.rope_backward(grad_y, cos, sin)
    return y if y.dtype == torch.float32 else (y.float() * 1.05).to(y.dtype)


def _refuses(*args):
    raise RuntimeError("no kernel image is available for execution on the device")


def test_correct_kernels_pass_and_wrong_ones_are_caught():
    assert run_self_check(torch_ops, CPU) == {}
    failures = run_self_check(fake_fused_extension(
        rms_norm_forward=_forgets_the_weight, bias_gelu_forward=_drops_the_last_column_when_odd,
        rope_backward=_bf16_rounds_twice, cross_entropy_stats=_refuses), CPU)
    assert set(failures) == {"layernorm", "bias_gelu", "rope", "cross_entropy"}
    assert failures["layernorm"].startswith("rms_norm_forward fp32 5x3x333: error ")
    assert failures["bias_gelu"].startswith("bias_gelu_forward fp32 3x7x333: error ")
    assert failures["rope"].startswith("rope_backward bf16 ")
    assert failures["cross_entropy"] == ("cross_entropy_stats fp32 37x333 raised RuntimeError: no kernel image is "
                                         "available for execution on the device")


def test_auto_switches_a_failed_op_off_with_one_line(monkeypatch, capsys):
    extension = fake_fused_extension(rms_norm_forward=_forgets_the_weight)
    monkeypatch.setattr(policy, "load_extension", lambda *a, **k: extension)
    auto = resolve(KernelPolicy("auto"), CPU)
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith("megalite: fused kernels layernorm run as torch ops on every rank: rank 0: "
                           "rms_norm_forward fp32 5x3x333: error ")
    assert line.endswith("> bound 1e-04")
    assert auto.ops("layernorm", FAKE_CUDA) is None
    assert all(auto.ops(op, FAKE_CUDA) is extension for op in OPS if op not in ("layernorm", "masked_softmax"))
    with pytest.raises(KernelSelfCheckFailed, match="failed their self-check on cpu.*layernorm: rms_norm_forward fp32"):
        resolve(KernelPolicy("on"), CPU)
    on = resolve(KernelPolicy("on", frozenset({"layernorm"})), CPU)   # --no-layernorm-fusion: nothing enabled failed
    assert all(on.ops(op, FAKE_CUDA) is extension for op in OPS if op != "layernorm")


def test_the_verdict_is_cached_per_device_torch_and_sources(monkeypatch):
    extension = fake_fused_extension(rope_forward=_refuses)
    monkeypatch.setattr(policy, "load_extension", lambda *a, **k: extension)
    assert resolve(KernelPolicy("auto"), CPU).ops("rope", FAKE_CUDA) is None
    cache = self_check.extensions_dir() / "megalite_fused" / self_check.CACHE_FILE
    (key, verdict), = json.loads(cache.read_text()).items()
    assert key == f"cpu | torch {torch.__version__} | sources {self_check.sources_hash(policy.EXTENSION_SOURCES)}"
    assert list(verdict) == ["rope"]
    # A new process (the memo cleared) reads the file instead of checking again ...
    monkeypatch.setattr(self_check, "_verdicts", {})
    monkeypatch.setattr(self_check, "run_self_check", lambda *a: pytest.fail("checked again"))
    auto = resolve(KernelPolicy("auto"), CPU)
    assert auto.ops("rope", FAKE_CUDA) is None and auto.ops("layernorm", FAKE_CUDA) is extension
    # ... until the sources change.
    monkeypatch.setattr(self_check, "_verdicts", {})
    monkeypatch.setattr(self_check, "sources_hash", lambda sources: "edited")
    monkeypatch.setattr(self_check, "run_self_check", lambda *a: {})
    assert resolve(KernelPolicy("auto"), CPU).ops("rope", FAKE_CUDA) is extension
    assert len(json.loads(cache.read_text())) == 2


def test_the_check_leaves_the_models_random_streams_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    run_self_check(torch_ops, CPU)
    assert torch.equal(torch.rand(3), expected)
