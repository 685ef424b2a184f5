"""Simulated GPUs (megalite.simulation): every layout the distributed tests check for equivalence also runs on 8
simulated H100s, every rank, under NCCL's rules; the planted defects of a first GPU run each turn a run red; the
peak memory agrees with the planner; a 1024-GPU Llama-2-70B job is checked in seconds.

These run in the in-process stage: a simulated world is a process of its own, with no torchrun."""

from __future__ import annotations

import re
import resource
import time

import pytest

import pretrain_gpt
from megalite.config.cli import parse_command_line
from megalite.planner.dry_run import run_memory
from megalite.run import Run
from megalite.simulation import simulate_rank
from megalite.simulation.communication import CommunicationContractError

from ..helpers import TINY, launch

# (TINY turns evaluation off, as a simulated run does anyway: megalite/simulation/run.py.)
ARGV = [*TINY, "--seq-length", "64", "--global-batch-size", "16", "--micro-batch-size", "1", "--simulate-gpus", "8"]

# The layouts of the equivalence tests (tests/multiprocess), on 8 ranks.
LAYOUTS = {
    "TP=2": "--tensor-model-parallel-size 2",
    "TP=2 SP": "--tensor-model-parallel-size 2 --sequence-parallel",
    "PP=2 1F1B": "--pipeline-model-parallel-size 2",
    "PP=2 V=2 interleaved": "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --num-layers 4",
    "PP=2 ZB-H1": "--pipeline-model-parallel-size 2 --pipeline-schedule zero-bubble",
    "PP=2 ZB-V": "--pipeline-model-parallel-size 2 --pipeline-schedule zbv --num-layers 4",
    "TP=2 x PP=2 x DP=2": "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel",
    "ZeRO-1 overlapped": "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
    "ZeRO-2": "--use-distributed-optimizer --zero-stage 2",
    "ZeRO-3": "--zero-stage 3",
    "CP=2 p2p": "--context-parallel-size 2 --cp-comm-type p2p --attention-dropout 0",
    "CP=2 a2a": "--context-parallel-size 2 --cp-comm-type a2a",
    "CP=2 allgather": "--context-parallel-size 2 --cp-comm-type allgather",
    "EP=4 alltoall": "model=moe_tiny --expert-model-parallel-size 4",
    "EP=2 allgather x TP=2": "model=moe_tiny --expert-model-parallel-size 2 --tensor-model-parallel-size 2 "
                             "--moe-token-dispatcher-type allgather",
    "FP8 delayed": "--fp8-format hybrid --fp8-recipe delayed",
    "FP8 tensorwise TP=2 SP": "--fp8-format e4m3 --fp8-recipe tensorwise --tensor-model-parallel-size 2 "
                              "--sequence-parallel",
    "FP8 rowwise": "--fp8-format e4m3 --fp8-recipe rowwise",
    "FP8 param gather ZeRO-1": "--fp8-format hybrid --use-distributed-optimizer --fp8-param-gather",
    "fp16 dynamic loss scale TP=2": "--fp16 --tensor-model-parallel-size 2",
    "recompute full": "--recompute-granularity full --recompute-method uniform --pipeline-model-parallel-size 2",
    "recompute selective": "--recompute-granularity selective --tensor-model-parallel-size 2 --sequence-parallel",
    "HSDP ZeRO-3 2 x 4": "--zero-stage 3 --num-distributed-optimizer-instances 2",
    "activation offloading TP=2 SP": "--fine-grained-activation-offloading --offload-modules attn_norm core_attn "
                                     "attn_proj mlp_norm --tensor-model-parallel-size 2 --sequence-parallel",
}


def config(argv: list[str]):
    argv = argv if "--fp16" in argv else argv + ["--bf16"]
    cfg = parse_command_line(argv, 8).config
    return Run.resolve(cfg, cfg.training.simulate_gpus)


def planned_total(run, pp_rank: int) -> float:
    return {stage.pp_rank: stage for stage in run_memory(run.cfg, run.dims.world, cuda=True)[1]}[pp_rank].total


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_of_the_layout_runs_on_8_simulated_gpus(layout):
    """Two iterations of every rank: no CPU tensor in a collective, p2p under one Work per batch, FP8 operands laid
    out for the kernel, a collective on every rank of each group. Tiny models are mostly fixed-size temporaries,
    which the planner does not count: their peaks agree within 30% (GPT-2 small's within 10%, below)."""
    cfg = config(ARGV + LAYOUTS[layout].split())
    for rank in range(8):
        report = simulate_rank(cfg, rank)
        ratio = report.peak_bytes / planned_total(cfg, report.coordinates["pp"])
        assert 0.7 < ratio < 1.3, (rank, ratio)
        assert report.communication, "a step without collectives"


CALIBRATED = ["TP=2 SP", "PP=2 ZB-V", "TP=2 x PP=2 x DP=2", "ZeRO-2", "ZeRO-3", "CP=2 p2p", "FP8 rowwise"]


@pytest.mark.parametrize("layout", CALIBRATED)
def test_the_planner_is_within_ten_percent_of_the_simulated_peak(layout):
    """GPT-2 small (8 layers, sequence 1024): the first and the last rank's peaks, simulated, against the planner's
    estimate for their stage (measured 0.95-1.07; the planner counted the cross entropy's softmax twice before)."""
    cfg = config(["model=gpt2_small", "--mock-data", "--bf16", "--seq-length", "1024", "--global-batch-size", "32",
                  "--micro-batch-size", "2", "--simulate-gpus", "8", "--attention-dropout", "0", "--num-layers", "8"]
                 + LAYOUTS[layout].replace("--num-layers 4", "").split())
    for rank in (0, 7):
        report = simulate_rank(cfg, rank)
        assert 0.9 < report.peak_bytes / planned_total(cfg, report.coordinates["pp"]) < 1.1


def test_weights_gradients_and_optimizer_states_are_the_planner_s_to_the_byte():
    cfg = config(ARGV + LAYOUTS["TP=2 x PP=2 x DP=2"].split())
    report = simulate_rank(cfg, 4)
    stage = {s.pp_rank: s for s in run_memory(cfg.cfg, 8, cuda=True)[1]}[1]
    found = report.peak_by_category
    assert (found["weights"], found["gradients"], found["optimizer"]) == \
        (stage.weights, stage.gradients, stage.optimizer)


def test_hsdp_s_reductions_free_their_scratch_shards_as_they_go():
    """HSDP (2 instances of 4) with the distributed optimizer, not overlapped, a model whose gradients dwarf its
    activations (hidden 4096, sequence 256, full recompute): each bucket's reduced shard is copied home and its
    scratch freed as soon as it is reduced (measured 1.021 x the planner's peak; held together until the last
    bucket, they added a quarter of the gradients: 1.104), and the collectives are named by level (reduce-scatter
    and gather inside the instance, all-reduce across), which the planner prices apart."""
    cfg = config(["model=gpt_tiny", "--mock-data", "--bf16", "--hidden-size", "4096", "--num-attention-heads", "32",
                  "--num-layers", "4", "--seq-length", "256", "--global-batch-size", "8", "--micro-batch-size", "1",
                  "--recompute-granularity", "full", "--recompute-method", "uniform", "--use-distributed-optimizer",
                  "--num-distributed-optimizer-instances", "2", "--simulate-gpus", "8"])
    report = simulate_rank(cfg, 0)
    assert 0.98 < report.peak_bytes / planned_total(cfg, 0) < 1.05
    kinds = {(op, kind) for op, kind in report.communication}
    assert {("reduce_scatter", "intra_instance"), ("all_gather", "intra_instance"),
            ("all_reduce", "inter_instance")} <= kinds


# ---- defects a first GPU run would hit, planted: each must turn a simulated run red ------------------------------

def test_a_cpu_tensor_in_a_collective_is_named_with_its_call_site(monkeypatch):
    from megalite.training import trainer
    original = trainer.parameter_counts
    monkeypatch.setattr(trainer, "parameter_counts", lambda params, device: original(params, "cpu"))
    with pytest.raises(CommunicationContractError, match=r"trainer\.py:\d+ \(parameter_counts\): all_reduce on a cpu "
                                                          r"tensor: NCCL serves meta tensors only"):
        simulate_rank(config(ARGV + ["--tensor-model-parallel-size", "2"]), 0)


def test_p2p_bookkeeping_that_expects_one_work_per_op_fails_under_nccl_s_coalesced_batches(monkeypatch):
    from megalite.pipeline import p2p
    monkeypatch.setattr(p2p, "_works_per_op", lambda works, num_ops: works)   # the old assumption
    with pytest.raises(RuntimeError, match="no receive posted"):
        simulate_rank(config(ARGV + ["--pipeline-model-parallel-size", "2"]), 0)


def test_a_row_major_second_fp8_operand_is_refused(monkeypatch):
    from megalite.tensor_parallel import fp8
    monkeypatch.setattr(fp8, "_kernel_layout", lambda a, b: (a.contiguous(), b.contiguous()))
    with pytest.raises(ValueError, match="column-major"):
        simulate_rank(config(ARGV + LAYOUTS["FP8 delayed"].split()), 0)


def test_an_fp16_step_is_taken_not_skipped_on_a_stand_in_overflow():
    """A stand-in value must steer a healthy step: the loss scaler's overflow check reads a flag (0: no overflow), so
    the optimizer steps and its states exist at the peak."""
    report = simulate_rank(config(ARGV + ["--fp16"]), 0)
    assert report.peak_by_category["optimizer"] == {s.pp_rank: s for s in run_memory(
        config(ARGV + ["--fp16"]).cfg, 8, cuda=True)[1]}[0].optimizer > 0


# ---- what it reports -------------------------------------------------------------------------------------------

def test_a_mixture_of_experts_reads_the_host_once_per_layer_and_micro_batch():
    report = simulate_rank(config(ARGV + LAYOUTS["EP=4 alltoall"].split()), 0)
    dispatcher = {site: n for site, n in report.host_reads.items() if "dispatcher.py" in site}
    assert sum(dispatcher.values()) == 2 * 2   # 2 MoE layers x 2 micro-batches (16 / (1 x DP 8))


def test_pretrain_gpt_prints_memory_and_collectives_and_exits_non_zero_on_a_broken_rule(monkeypatch, capsys):
    argv = ARGV + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--simulate-rank", "5"]
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "simulated rank 5 of 8 (TP rank 1, CP rank 0, DP rank 0, PP rank 1)" in out
    assert re.search(r"all_reduce over tensor \(2\)\s+\d+", out) and "send over pipeline (2)" in out
    assert re.search(r"simulated / planned \d\.\d{3}", out)
    from megalite.training import trainer
    original = trainer.parameter_counts
    monkeypatch.setattr(trainer, "parameter_counts", lambda params, device: original(params, "cpu"))
    assert pretrain_gpt.main(argv[:-1] + ["4,5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("megalite: error: simulated rank") for line in err)


def test_bad_simulation_options_are_one_line_each(capsys):
    assert pretrain_gpt.main(ARGV + ["--simulate-rank", "8"]) == 2
    assert pretrain_gpt.main(ARGV + ["--simulate-device", "v100"]) == 2
    err = capsys.readouterr().err
    assert "--simulate-rank must be ranks below --simulate-gpus 8" in err
    assert "--simulate-device must be h100, h200, a100 or b200, got 'v100'" in err


def test_llama2_70b_on_1024_simulated_h100s_first_and_last_rank():
    """The README's scale check: TP 8 x PP 8 x DP 16, sequence 4096, bf16, distributed optimizer, sequence
    parallelism, selective recompute, global batch 1024 (64 micro-batches): both ranks in well under 5 minutes and
    4 GiB of host memory, each peak within 10% of the planner's."""
    argv = ["pretrain_gpt.py", "model=llama2_70b", "--mock-data", "--bf16",
            "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8", "--sequence-parallel",
            "--use-distributed-optimizer", "--recompute-granularity", "selective", "--micro-batch-size", "1",
            "--global-batch-size", "1024", "--simulate-gpus", "1024", "--simulate-rank", "0,1023"]
    start = time.perf_counter()
    done = launch(argv, timeout=300)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    assert seconds < 300
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < 4 * 2**20   # KiB: under 4 GiB
    ratios = [float(r) for r in re.findall(r"planned \d+\.\d+ GiB \((\d\.\d+)\)", done.stdout)]
    assert len(ratios) == 2 and all(0.9 < r < 1.1 for r in ratios), done.stdout
