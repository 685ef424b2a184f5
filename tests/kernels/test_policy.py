"""Choosing between the fused kernels and torch ops: CPU tensors, ``off`` and a policy not prepared always get torch
ops, a missing GPU, CUDA build of torch or compiler falls back with one line under ``auto`` and is an error under
``on``, the flags reach the policy."""

from __future__ import annotations

import types

import pytest
import torch

from megalite import extensions
from megalite.config.cli import parse_args
from megalite.config import ConfigError, KernelConfig, validate
from megalite.kernels import policy
from megalite.kernels.agreement import prepare, resolve
from megalite.kernels.policy import OPS, ExtensionUnavailable, KernelPolicy

from ..helpers import fake_fused_extension

# What the policy looks at in a tensor; the self-check runs on the CPU here.
CPU = torch.device("cpu")
FAKE_CUDA = types.SimpleNamespace(is_cuda=True, device=CPU)

pytestmark = pytest.mark.usefixtures("fresh_extension_cache")   # tests/conftest.py


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_cpu_tensors_always_run_torch_ops_and_never_build(mode, monkeypatch):
    monkeypatch.setattr(policy, "load_extension", lambda *a, **k: pytest.fail("no build for CPU tensors"))
    prepared = prepare(KernelPolicy(mode), CPU)
    assert prepared == KernelPolicy(mode) and prepared.extension is None
    for op in OPS:
        assert prepared.ops(op, torch.zeros(2)) is None


def test_off_and_per_op_switches_give_torch_ops_on_cuda(monkeypatch):
    monkeypatch.setattr(policy, "load_extension", lambda *a, **k: pytest.fail("nothing to build"))
    for unused in (KernelPolicy("off"), KernelPolicy("on", frozenset(OPS))):
        prepared = prepare(unused, torch.device("cuda", 0))   # nothing enabled: nothing to build
        assert all(prepared.ops(op, FAKE_CUDA) is None for op in OPS)


def test_a_policy_not_prepared_runs_torch_ops_and_builds_nothing(monkeypatch):
    monkeypatch.setattr(policy, "load_extension", lambda *a, **k: pytest.fail("no build inside a forward"))
    assert all(KernelPolicy(mode).ops(op, FAKE_CUDA) is None for mode in ("auto", "on") for op in OPS)


def test_auto_fuses_all_but_the_attention_core_which_on_adds(monkeypatch):
    extension = fake_fused_extension()
    monkeypatch.setattr(policy, "load_extension", lambda *a, **k: extension)
    auto = resolve(KernelPolicy("auto"), CPU)
    assert {op for op in OPS if auto.ops(op, FAKE_CUDA) is extension} == set(OPS) - {"masked_softmax"}
    assert all(resolve(KernelPolicy("on"), CPU).ops(op, FAKE_CUDA) is extension for op in OPS)
    assert resolve(KernelPolicy("on", frozenset({"masked_softmax"})), CPU).ops("masked_softmax", FAKE_CUDA) is None


def test_auto_falls_back_with_one_line_and_on_raises_when_the_extension_cannot_be_built(monkeypatch, capsys):
    # This machine's torch is a CPU build; pretend it is a CUDA one without a toolkit, as on a GPU box without nvcc.
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.8")
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    auto = resolve(KernelPolicy("auto"), CPU)
    assert all(auto.ops(op, FAKE_CUDA) is None for op in OPS)
    assert capsys.readouterr().err.splitlines() == [
        "megalite: fused kernels bias_gelu, layernorm, rope, cross_entropy run as torch ops on every rank: rank 0: "
        "cannot build extension 'megalite_fused': no CUDA toolkit found (nvcc on the PATH, or CUDA_HOME)"]
    with pytest.raises(ExtensionUnavailable, match="no CUDA toolkit"):
        resolve(KernelPolicy("on"), CPU)


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the message of a CPU build of torch")
def test_a_cpu_build_of_torch_says_so():
    with pytest.raises(ExtensionUnavailable, match="built without CUDA"):
        policy.fused_extension(required=True)


def test_disabled_extensions_mean_torch_ops(monkeypatch):
    monkeypatch.setenv(extensions.DISABLE_ENV, "1")
    assert resolve(KernelPolicy("auto"), CPU).ops("layernorm", FAKE_CUDA) is None
    with pytest.raises(ExtensionUnavailable, match=extensions.DISABLE_ENV):
        resolve(KernelPolicy("on"), CPU)


def test_flags_and_hydra_keys_reach_the_policy():
    cfg = parse_args(["--use-fused-kernels", "off", "--no-bias-gelu-fusion", "--no-rope-fusion",
                      "kernels.no_cross_entropy_loss_fusion=true", "--mock-data"])
    assert KernelPolicy.from_config(cfg.kernels) == KernelPolicy("off", frozenset({"bias_gelu", "rope",
                                                                                   "cross_entropy"}))
    assert KernelPolicy.from_config(KernelConfig()) == KernelPolicy()
    switches = [f"--no-{name}" for name in ("masked-softmax-fusion", "bias-gelu-fusion", "layernorm-fusion",
                                             "rope-fusion", "cross-entropy-loss-fusion")]
    everything_off = KernelPolicy.from_config(parse_args(switches + ["--mock-data"]).kernels)
    assert everything_off.disabled == frozenset(OPS)


def test_on_without_a_gpu_is_refused_by_validation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="--use-fused-kernels on needs a CUDA device"):
        validate(parse_args(["--use-fused-kernels", "on", "--mock-data"]), 1)
    validate(parse_args(["--use-fused-kernels", "auto", "--mock-data"]), 1)
    with pytest.raises(ConfigError, match="must be auto, on or off, got 'yes'"):
        validate(parse_args(["--use-fused-kernels", "yes", "--mock-data"]), 1)


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="auto, on, off"):
        KernelPolicy("sometimes")
    with pytest.raises(ValueError, match="unknown fused ops"):
        KernelPolicy("auto", frozenset({"flash"}))


def test_torch_compile_leaves_the_layers_ops_to_the_compiler():
    """Inside a compiled layer an extension call would break the graph; the loss, outside the layers, stays fused."""
    compiled = KernelPolicy.from_config(KernelConfig(torch_compile=True))
    assert [op for op in OPS if compiled.enabled(op)] == [policy.CROSS_ENTROPY]
    assert [op for op in OPS if KernelPolicy.from_config(KernelConfig()).enabled(op)] == [
        op for op in OPS if op != policy.MASKED_SOFTMAX]
