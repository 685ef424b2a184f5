"""End to end: every parallel layout trains exactly like the single process.

Same seed and global batch, dropout off, fp32: 10 iterations, per-iteration loss and gradient norm within 1e-5
relative, and the final weights (gathered over TP, compared per pipeline stage by canonical name) within 1e-5.
The initial weights are compared too, since layout independence starts there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from megalite import parallel_state
from megalite.config import ParallelConfig
from megalite.training import Trainer

from ..helpers import max_relative_difference, single_layout, tiny_config, with_checkpoint
from .groups import layout, requires_world
from .equivalence import CPU, check_against_reference, full_parameters, reference, resumed_losses, train


@requires_world(4)
@pytest.mark.parametrize("tp, pp, v, ranks, micro_batch_size, torch_compile", [
    (2, 1, 1, None, 2, False),          # TP=2 x DP=2
    (4, 1, 1, None, 2, False),          # TP=4
    (1, 1, 1, [0, 1], 2, False),        # DP=2
    (1, 1, 1, None, 1, False),          # DP=4 with smaller micro-batches (more accumulation steps)
    (2, 1, 1, [0, 1], 1, False),        # TP=2 alone
    (1, 2, 1, None, 1, False),          # PP=2 x DP=2, 1F1B
    (1, 4, 1, None, 1, False),          # PP=4, 1F1B
    (1, 2, 2, [0, 1], 1, False),        # PP=2, V=2: interleaved
    (2, 2, 1, None, 1, False),          # TP=2 x PP=2
    (2, 2, 1, None, 1, True),           # TP=2 x PP=2, --torch-compile (aot_eager) against the eager reference
])
def test_losses_and_weights_match_single_process(tp, pp, v, ranks, micro_batch_size, torch_compile):
    cfg = tiny_config(tp=tp, pp=pp, model={"num_layers": 4},
                      parallel={"num_virtual_stages_per_pipeline_rank": v if v > 1 else None},
                      training={"micro_batch_size": micro_batch_size},
                      kernels={"torch_compile": torch_compile, "torch_compile_backend": "aot_eager"})
    counters.clear()
    check_against_reference(cfg, ranks, f"tp={tp} pp={pp} v={v} ranks={ranks} mbs={micro_batch_size} "
                                        f"compile={torch_compile}")
    # Compiled: the TP collectives trace (no graph break), each stage's two layers share their graphs (training and
    # evaluation: two), none recompiled over the 10 steps.
    if torch_compile:
        assert not counters["graph_break"]
        assert counters["stats"]["unique_graphs"] == 2


@requires_world(8)
def test_three_dimensional_layout_matches_single_process():
    cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4}, training={"micro_batch_size": 1})
    check_against_reference(cfg, label="tp=2 pp=2 dp=2")


@requires_world(8)
def test_three_dimensional_interleaved_layout_matches_single_process():
    cfg = tiny_config(tp=2, pp=2, model={"num_layers": 4}, parallel={"num_virtual_stages_per_pipeline_rank": 2},
                      training={"micro_batch_size": 1})
    check_against_reference(cfg, label="tp=2 pp=2 v=2 dp=2")


@requires_world(4)
def test_tied_embedding_copies_stay_identical_across_stages():
    cfg = tiny_config(pp=2, training={"micro_batch_size": 1, "train_iters": 5})
    with layout(1, 2, ranks=[0, 1]) as member:
        if not member:
            return
        trainer = Trainer.on_registered_layout(cfg, CPU)
        trainer.train()
        weights = [w for chunk in trainer.model for w in chunk.tied_embedding_weights()]
        assert len(weights) == 1
        if parallel_state.is_pipeline_last_stage():
            assert getattr(weights[0], "is_embedding_copy", False)
        info = parallel_state.get_embedding_group()
        gathered = [torch.empty_like(weights[0]) for _ in range(info.size)]
        dist.all_gather(gathered, weights[0].detach(), group=info.group)
        assert torch.equal(gathered[0], gathered[1])


@requires_world(4)
@pytest.mark.parametrize("untie", [False, True])
def test_initial_weights_are_layout_independent(untie):
    cfg = tiny_config(tp=2, pp=2, model={"untie_embeddings_and_output_weights": untie})
    with single_layout():
        expected = full_parameters(Trainer.on_registered_layout(dataclasses.replace(cfg, parallel=ParallelConfig()), CPU))
    with layout(2, 2):
        actual = full_parameters(Trainer.on_registered_layout(cfg, CPU))
    assert actual.keys() <= expected.keys()
    for name in actual:
        assert torch.equal(actual[name], expected[name]), name


@requires_world(4)
def test_bf16_stays_close_to_fp32():
    cfg = tiny_config(tp=2, training={"bf16": True, "train_iters": 20})
    with single_layout():
        fp32 = Trainer.on_registered_layout(tiny_config(training={"train_iters": 20}), CPU).train()
    with layout(2):
        bf16 = Trainer.on_registered_layout(cfg, CPU).train()
    final = [[r for r in run if "loss" in r][-1]["loss"] for run in (bf16, fp32)]
    print(f"bf16 vs fp32 after 20 iterations: {final[0]:.5f} vs {final[1]:.5f} "
          f"({abs(final[0] - final[1]) / final[1]:.2%})")
    assert abs(final[0] - final[1]) / final[1] < 0.02



def _histories_agree_over_data_parallel(trainer):
    info = parallel_state.get_data_parallel_group()
    for name, history in trainer.fp8_histories:
        copies = [torch.empty_like(history.history) for _ in range(info.size)]
        dist.all_gather(copies, history.history, group=info.group)
        assert all(torch.equal(copy, history.history) for copy in copies), name


@requires_world(4)
@pytest.mark.parametrize("recipe, tp, pp, ranks", [
    ("delayed", 2, 1, None),        # TP=2 (sequence parallel) x DP=2: histories maxed over TP and DP
    ("delayed", 1, 2, None),        # PP=2 x DP=2
    ("rowwise", 2, 1, [0, 1]),      # TP=2, sequence parallel (the first step of delayed is tensorwise)
])
def test_fp8_layouts_match_single_process(recipe, tp, pp, ranks):
    """FP8 (hybrid) runs in fp32 here (the Trainer takes it; pretrain_gpt asks for --bf16), so what differs from the
    single process is FP8's own rounding: every layout scales by the whole tensors' amaxes, but an input or amax
    that differs in its last fp32 bit (another summation order) moves the odd element to the neighbouring FP8 value
    (an e5m2 gradient by 25%), and the runs drift apart from there. Measured over 6 iterations (4 run here): losses within
    4e-5 relative, gradient norms within 3e-3 (over 10 iterations of 4 layers: 2e-4 and 1.1e-2); the first loss,
    before any update, within 1e-7 (without the TP max of the amaxes: 1e-5 to 5e-5 off, and the test fails). The
    amax histories are the same on every data-parallel replica (without the max over DP they are not)."""
    cfg = tiny_config(tp=tp, pp=pp, model={"fp8_format": "hybrid", "fp8_recipe": recipe, "fp8_amax_history_len": 4,
                                           "fp8_amax_compute_algo": "max"},
                      parallel={"sequence_parallel": tp > 1},
                      training={"micro_batch_size": 1, "global_batch_size": 4, "train_iters": 4},
                      data={"eval_interval": 0})
    expected, _ = reference(cfg)
    result = train(cfg, ranks, inspect=_histories_agree_over_data_parallel)
    if result is None:
        return
    runs = [[r for r in records if "loss" in r] for records in (result[0], expected)]
    loss_diff = max_relative_difference(*[[r["loss"] for r in run] for run in runs])
    norm_diff = max_relative_difference(*[[r["grad_norm"] for r in run] for run in runs])
    first = abs(runs[0][0]["loss"] - runs[1][0]["loss"]) / runs[1][0]["loss"]
    print(f"FP8 {recipe} TP={tp} PP={pp}: first loss {first:.1e}, max rel loss diff {loss_diff:.1e}, grad norm "
          f"diff {norm_diff:.1e}")
    assert first < 1e-6 and loss_diff < 1e-3 and norm_diff < 3e-2


def _count_gathered_products(monkeypatch) -> list[bool]:
    """Record, for every FP8 product from now on, whether it multiplied by a gathered FP8 weight."""
    from megalite.tensor_parallel import fp8_linear   # noqa: PLC0415

    original, used = fp8_linear.gathered_fp8_weight, []

    def counting(weight):
        found = original(weight)
        used.append(found is not None)
        return found

    monkeypatch.setattr(fp8_linear, "gathered_fp8_weight", counting)
    return used


@requires_world(4)
@pytest.mark.parametrize("recipe, tp, zero, overlap", [
    ("tensorwise", 1, 1, True),     # DP=4, ZeRO-1, overlapped gathers
    ("delayed", 2, 2, False),       # TP=2 (sequence parallel) x DP=2, ZeRO-2
])
def test_fp8_param_gather_takes_the_same_steps_on_half_the_bytes(recipe, tp, zero, overlap, monkeypatch):
    """--fp8-param-gather quantizes each weight shard with the whole weight's scale and gathers the bytes the
    forward would have made itself: losses, gradient norms, evaluation losses and final weights (refreshed in bf16
    at the end) equal those of the same layout without it, bit for bit, and the FP8 linears' weights cross the data
    group in 1 byte an element instead of 2."""
    from bench.comm_counter import count_communication   # noqa: PLC0415 - the benchmarks' counter, run as a test

    from megalite.tensor_parallel.fp8_linear import GATHERED   # noqa: PLC0415

    cfg = tiny_config(tp=tp, model={"fp8_format": "hybrid", "fp8_recipe": recipe},
                      parallel={"sequence_parallel": tp > 1},
                      optimizer={"use_distributed_optimizer": True, "zero_stage": zero,
                                 "overlap_param_gather": overlap},
                      training={"micro_batch_size": 1, "train_iters": 4, "bf16": True},
                      data={"eval_interval": 2, "eval_iters": 1})
    runs, counters, fp8_elements, used = [], [], [], _count_gathered_products(monkeypatch)
    for gather in (False, True):
        used.clear()
        run_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8_param_gather=gather))
        with layout(tp, 1) as member:
            assert member
            trainer = Trainer.on_registered_layout(run_cfg, CPU)
            with count_communication() as counter:
                records = trainer.train()
            carriers = [p for p in trainer.model.parameters() if getattr(p, GATHERED, None) is not None]
            fp8_elements.append(sum(b.end - b.start for b in trainer.engine.buckets
                                    if any(id(b.params[0]) == id(p) for p in carriers)))
            runs.append((records, full_parameters(trainer)))
            counters.append(counter)
        # Every product after the first step's forward takes the gathered weight (none without the option).
        assert sum(used) == (0 if not gather else len(used) - 4 * cfg.model.num_layers * trainer.num_micro_batches)
    (plain, plain_weights), (gathered, gathered_weights) = runs
    assert fp8_elements[0] == 0 and fp8_elements[1] > 0
    assert [r.get("loss") for r in gathered] == [r.get("loss") for r in plain]
    assert [r.get("grad_norm") for r in gathered] == [r.get("grad_norm") for r in plain]
    assert [r.get("eval_loss") for r in gathered] == [r.get("eval_loss") for r in plain]
    assert all(torch.equal(gathered_weights[name], plain_weights[name]) for name in plain_weights)
    steps, refreshes = cfg.training.train_iters, 2   # the bf16 refreshes: the evaluations after iterations 2 and 4
    saved = counters[0].bytes("all_gather", "data") - counters[1].bytes("all_gather", "data")
    # Each gather of an FP8 bucket sends 1 byte an element for 2; each refresh sends the bf16 again.
    expected = fp8_elements[1] * (2 - 1) * steps - fp8_elements[1] * 2 * refreshes
    print(f"--fp8-param-gather {recipe} TP={tp} ZeRO-{zero}: identical steps; data-group all-gather bytes "
          f"{counters[1].bytes('all_gather', 'data'):,} vs {counters[0].bytes('all_gather', 'data'):,} in bf16 "
          f"(FP8 buckets {fp8_elements[1]:,} elements)")
    assert saved == expected


@requires_world(4)
def test_fp8_sequence_parallel_gathers_move_one_byte_an_element():
    """TP=2 with sequence parallelism: each layer's column-parallel linears (query/key/value and the MLP's first)
    all-gather their FP8 input shard in forward and again for the weight gradient, 4 gathers of b x s x h elements a
    layer and micro-batch at 1 byte instead of bf16's 2; every other tensor-group gather is as in bf16."""
    from bench.comm_counter import count_communication   # noqa: PLC0415 - the benchmarks' counter, run as a test

    cfg = tiny_config(tp=2, parallel={"sequence_parallel": True},
                      training={"micro_batch_size": 1, "train_iters": 1, "bf16": True}, data={"eval_interval": 0})
    gathered = []
    for fp8 in (None, "hybrid"):
        run_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8_format=fp8,
                                                                     fp8_recipe="tensorwise"))
        with layout(2, 1, ranks=[0, 1]) as member:
            if member:
                trainer = Trainer.on_registered_layout(run_cfg, CPU)
                with count_communication() as counter:
                    trainer.train_step()
                gathered.append(counter.bytes("all_gather", "tensor"))
    if not gathered:
        return
    m = cfg.model
    saved = 4 * cfg.training.micro_batch_size * m.seq_length * m.hidden_size * m.num_layers * trainer.num_micro_batches
    print(f"FP8 sequence-parallel gathers: {gathered[1]:,} bytes a step against bf16's {gathered[0]:,} "
          f"({gathered[1] / gathered[0]:.3f})")
    assert gathered[0] - gathered[1] == saved


@requires_world(4)
@pytest.mark.parametrize("recipe, tp", [("delayed", 2)])   # (tensorwise: the ZeRO-1 test above)
def test_fp8_param_gather_at_zero3_takes_the_same_steps_on_half_the_bytes(recipe, tp, monkeypatch, directory):
    """ZeRO-3 (FSDP2, TP=2 with sequence parallelism x DP=2) with --fp8-param-gather: FSDP2 all-gathers the
    FP8 linears' weights as the FP8 bytes the forward would have made of them (their all-gather extension), in
    forward and in backward's re-gather: the same losses, gradient norms, evaluation losses and final weights as
    without it, bit for bit, one byte an element fewer for every gathered FP8 weight element, and a checkpoint saved
    after 2 iterations resumes to the same last 2 losses."""
    from bench.comm_counter import count_communication   # noqa: PLC0415 - the benchmarks' counter, run as a test

    cfg = tiny_config(tp=tp, model={"fp8_format": "hybrid", "fp8_recipe": recipe},
                      parallel={"sequence_parallel": tp > 1}, optimizer={"zero_stage": 3},
                      training={"micro_batch_size": 1, "train_iters": 4, "bf16": True},
                      data={"eval_interval": 2, "eval_iters": 1})
    runs, counters, used = [], [], _count_gathered_products(monkeypatch)
    for gather in (False, True):
        used.clear()
        run_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8_param_gather=gather))
        run_cfg = with_checkpoint(run_cfg, save=f"{directory}/{gather}", save_interval=2)
        with layout(tp, 1) as member:
            assert member
            trainer = Trainer.on_registered_layout(run_cfg, CPU)
            with count_communication() as counter:
                records = trainer.train()
            fp8_weights = sum(m.weight.numel() for m in trainer.model.modules()
                              if getattr(m, "fp8", None) is not None)
            runs.append((records, full_parameters(trainer)))
            counters.append(counter)
        assert sum(used) == (len(used) if gather else 0) and used   # every FP8 product, from the first
    (plain, plain_weights), (gathered, gathered_weights) = runs
    assert [r.get("loss") for r in gathered] == [r.get("loss") for r in plain]
    assert [r.get("grad_norm") for r in gathered] == [r.get("grad_norm") for r in plain]
    assert [r.get("eval_loss") for r in gathered] == [r.get("eval_loss") for r in plain]
    assert all(torch.equal(gathered_weights[name], plain_weights[name]) for name in plain_weights)
    bf16, fp8 = (c.bytes("all_gather", "data") for c in counters)
    # Every micro-batch gathers each layer twice (forward, backward), every evaluation micro-batch once.
    micro_batches, evaluations = trainer.num_micro_batches, 2
    gathers = 2 * micro_batches * cfg.training.train_iters + micro_batches * evaluations * cfg.data.eval_iters
    print(f"--fp8-param-gather {recipe} at ZeRO-3: identical steps; data-group all-gather bytes {fp8:,} vs {bf16:,} "
          f"in bf16 ({fp8 / bf16:.3f})")
    assert bf16 - fp8 == fp8_weights * gathers
    resumed = resumed_losses(with_checkpoint(run_cfg, load=f"{directory}/True/iter_0000002", save=None), tp, 1,
                             None, 2)
    assert resumed == [r["loss"] for r in gathered if "loss" in r][2:]
