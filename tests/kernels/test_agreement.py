"""The fused kernels' verdict agreed over the ranks: per-op flags whose MIN over the ranks names the first rank where
an op failed, so one rank's failure switches the op off on every rank; rank 0's line names op, rank and why;
``--use-fused-kernels on`` fails before any collective. The 4-rank run is in tests/multiprocess/test_fused_cross_entropy.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megalite.kernels import agreement, policy
from megalite.kernels.agreement import agreed_failures, failure_lines, resolve, verdict_flags
from megalite.kernels.policy import OPS, ExtensionUnavailable, KernelPolicy

from ..helpers import fake_fused_extension

pytestmark = pytest.mark.usefixtures("fresh_extension_cache")   # tests/conftest.py


def _agree(failed_by_rank: list[set[str]]) -> dict[str, int]:
    """What the all_reduce (MIN) of every rank's flags gives each rank."""
    world = len(failed_by_rank)
    flags = torch.tensor([verdict_flags(failed, rank, world) for rank, failed in enumerate(failed_by_rank)])
    return agreed_failures(flags.min(dim=0).values.tolist(), world)


def test_an_op_that_failed_on_any_rank_is_agreed_off_naming_the_first_rank():
    assert _agree([set(), set(), set(), set()]) == {}
    assert _agree([set(), {"rope"}, set(), {"rope", "layernorm"}]) == {"rope": 1, "layernorm": 3}
    assert _agree([set(OPS)] + [set()] * 7) == dict.fromkeys(OPS, 0)
    assert _agree([{"bias_gelu"}]) == {"bias_gelu": 0}


def test_rank_0_prints_one_line_per_rank_and_reason():
    assert failure_lines({"rope": 1, "layernorm": 3, "bias_gelu": 1}, {"rope": "bad", "bias_gelu": "bad",
                                                                        "layernorm": "worse"}) == [
        "megalite: fused kernels rope, bias_gelu run as torch ops on every rank: rank 1: bad",
        "megalite: fused kernels layernorm run as torch ops on every rank: rank 3: worse"]


def test_on_fails_on_its_own_rank_before_any_collective(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)   # as in a distributed run ...
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("a collective before the error"))
    monkeypatch.setattr(policy, "load_extension", lambda *a, **k: (_ for _ in ()).throw(
        ExtensionUnavailable("cannot build extension 'megalite_fused': nvcc fatal")))
    with pytest.raises(ExtensionUnavailable, match="nvcc fatal"):
        resolve(KernelPolicy("on"), torch.device("cpu"))


def test_the_build_lock_waits_up_to_the_given_timeout(monkeypatch):
    seen = {}
    monkeypatch.setattr(policy, "load_extension", lambda *a, **k: seen.update(k) or fake_fused_extension())
    monkeypatch.setattr(agreement, "agree", lambda failed, device: {})
    resolve(KernelPolicy("auto"), torch.device("cpu"), lock_timeout_s=600)
    assert seen == {"required": True, "lock_timeout_s": 600}


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks a CPU build of torch")
def test_the_build_command_on_a_machine_without_cuda_says_so_and_succeeds(capsys):
    from megalite.kernels.__main__ import main
    assert main(["build"]) == 0
    assert "built without CUDA: no fused kernels to build here, runs use torch ops" in capsys.readouterr().out


def test_on_that_cannot_build_is_one_line_from_the_entry_point(monkeypatch, capsys):
    """As on a GPU machine without nvcc (the trainer's prepare runs as on a GPU: this machine's device is the CPU)."""
    import pretrain_gpt
    from megalite import run
    from megalite.training import parallelize

    def validate_as_on_a_gpu(cfg, world_size, validate=run.validate):
        with pytest.MonkeyPatch.context() as patch:   # --use-fused-kernels on passes validation
            patch.setattr(torch.cuda, "is_available", lambda: True)
            validate(cfg, world_size)
    monkeypatch.setattr(run, "validate", validate_as_on_a_gpu)
    monkeypatch.setattr(parallelize, "prepare", resolve)
    monkeypatch.setattr(policy, "load_extension", lambda *a, **k: (_ for _ in ()).throw(
        ExtensionUnavailable("cannot build extension 'megalite_fused': no CUDA toolkit found")))
    assert pretrain_gpt.main(["model=gpt_tiny", "--mock-data", "--train-iters", "1", "--use-fused-kernels", "on",
                              "--no-masked-softmax-fusion"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "megalite: error: rank 0: cannot build extension 'megalite_fused': no CUDA toolkit found")
