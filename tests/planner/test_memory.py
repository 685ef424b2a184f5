"""Memory estimates against what megalite really allocates, in one process on the CPU.

Model states: the real DataParallel + MegaliteOptimizer (Adam states materialized by one step) built for one rank of
a layout (a shape-only ``simulated_layout``: no collective runs at construction), against the planner's weights,
gradients and optimizer bytes: the tolerance is 1%; measured: equal to the byte. ZeRO-3's (FSDP2's row shards, and
its working memory) need a real process group: tests/multiprocess/test_planner_zero3.py; here, their arithmetic.

Activations: what autograd keeps for a whole model chunk's forward and loss, read with saved-tensor hooks
(tests/activation_memory.py), against the planner with the CPU's numerics: the tolerance is 15%; measured: equal up
to 16 bytes. TP > 1 runs in one process by replacing the three collectives with shape-correct local stand-ins (the
values are wrong, the shapes, hence the saved bytes, are right); tests/multiprocess/test_activation_memory.py checks
the same per-layer bytes with real TP=2 groups, against the formula this planner matches below.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megalite import parallel_state
from megalite.config import OptimizerConfig, TrainingConfig
from megalite.distributed import DataParallel
from megalite.model import GPTModel
from megalite.model.context_parallel import shard_sequence
from megalite.model.multi_token_prediction import multi_token_targets
from megalite.optimizer import MegaliteOptimizer
from megalite.pipeline.partition import chunks_of_rank
from megalite.planner import (Layout, Numerics, bytes_per_parameter, count_parameters, load_model_config,
                              model_state_bytes, stage_memory)
from megalite.planner.memory import (_chunk_activation_bytes, activation_bytes, layer_activation_bytes,
                                     peak_in_flight_bytes)
from megalite.tensor_parallel import TensorParallelRNG

from ..activation_memory import korthikanti_bytes, layer_norm_statistics_bytes, saved_bytes
from ..helpers import TINY_MOE, tiny_config

def zero_paper_bytes_per_parameter(stage: int, n: int) -> float:
    """The ZeRO paper's mixed-precision Adam (Rajbhandari et al. 2020, K = 12): 16, 4 + 12/N, 2 + 14/N, 16/N."""
    return {0: 16.0, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[stage]


LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True, "ffn_hidden_size": 176,
         "group_query_attention": True, "num_query_groups": 2, "disable_bias_linear": True,
         "untie_embeddings_and_output_weights": True}
MODULES = {"recompute_granularity": "selective"}   # with "recompute_modules": Megatron's --recompute-modules
OFFLOAD = {"fine_grained_activation_offloading": True}   # with "offload_modules": Megatron's --offload-modules
DENSE_OFFLOAD = {**OFFLOAD, "offload_modules": "attn_norm core_attn attn_proj mlp_norm"}


# ---- model states ---------------------------------------------------------------------------------------------------

def _measured_states(model, layout: Layout, pp_rank: int, dtype: torch.dtype, bucket_size=None):
    with parallel_state.simulated_layout(layout.tp, layout.pp, layout.dp, pp_rank=pp_rank):
        chunks = torch.nn.ModuleList(
            GPTModel(model, None, pre_process=c.is_first, post_process=c.is_last, layer_offset=c.first_layer,
                     num_layers=c.num_layers)
            for c in chunks_of_rank(model.num_layers, layout.pp, layout.virtual_stages, pp_rank)).to(dtype)
        engine = DataParallel(list(chunks), data_group=parallel_state.get_data_parallel_group(),
                              embedding_group=parallel_state.get_embedding_group(),
                              tied_params=[w for c in chunks for w in c.tied_embedding_weights()],
                              bucket_size=bucket_size, zero=layout.zero, fp8_param_gather=model.fp8_param_gather)
        optimizer = MegaliteOptimizer(engine, OptimizerConfig(**OptimizerConfig.zero_settings(layout.zero),
                                                              optimizer="muon" if layout.muon else "adam"),
                                      TrainingConfig(bf16=dtype == torch.bfloat16))
        for piece in optimizer.pieces:   # Adam allocates its states on the first step
            piece.main.grad = torch.zeros_like(piece.main)
        optimizer.inner.step()
        for piece in optimizer.muon.pieces if optimizer.muon is not None else []:
            optimizer.muon.momentum_buffer(piece)
        weights = engine.param_buffer.untyped_storage().nbytes() + (
            sum(b.untyped_storage().nbytes() for b in engine.fp8.buffers.values()) if engine.fp8 else 0)
        grads = (sum(s.untyped_storage().nbytes() for s in engine.grad_shards) if engine.zero2
                 else engine.grad_buffer.untyped_storage().nbytes())
        return weights, grads, optimizer.state_bytes()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("layout, bucket_size", [
    (Layout(), None),
    (Layout(dp=4, zero=1), None),
    (Layout(dp=4, zero=2), 3000),          # several buckets, each padded
    (Layout(tp=2, pp=2, dp=2, zero=1), None),           # tied embedding copy on the last stage
    (Layout(pp=2, dp=3, virtual_stages=2, zero=2), 5000),
    (Layout(tp=4, dp=2), None),
    (Layout(tp=2, pp=2, dp=2, zero=1, muon=True), None),   # Muon's one buffer for the hidden matrices
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [None, "param gather"])
def test_model_states_match_the_allocated_tensors(arch, layout, bucket_size, dtype, fp8):
    """Also with FP8 linears, whose weights get buckets of their own under the distributed optimizer, and with
    --fp8-param-gather the FP8 copies those buckets are gathered into."""
    options = {"fp8_format": "hybrid", "fp8_param_gather": True} if fp8 else {}
    model = tiny_config(model={"num_layers": 4, **(LLAMA if arch == "llama" else {}), **options}).model
    for pp_rank in range(layout.pp):
        measured = _measured_states(model, layout, pp_rank, dtype, bucket_size)
        planned = model_state_bytes(model, layout, pp_rank, dtype_bytes=dtype.itemsize, bucket_size=bucket_size)
        for name, m, p in zip(("weights", "gradients", "optimizer"), measured,
                              (planned.weights, planned.gradients, planned.optimizer)):
            print(f"{arch} {layout.describe()} {dtype} stage {pp_rank} {name}: measured {m}, planned {p:.0f}")
            assert abs(p - m) <= 0.01 * m, name


def test_bytes_per_parameter_are_the_published_numbers_with_fp32_gradients():
    assert bytes_per_parameter(0, 8) == 18                               # Megatron: bf16 params, fp32 grads
    assert bytes_per_parameter(1, 8) == 6 + 12 / 8                      # ... distributed optimizer: 6 + 12/d
    assert bytes_per_parameter(2, 8) == 2 + 16 / 8                      # fp32 gradient shards: ZeRO's 2 + 14/N + 2/N
    assert bytes_per_parameter(0, 8, dtype_bytes=4) == 16                # fp32: 16 vs 8 + 8/d
    assert bytes_per_parameter(1, 8, dtype_bytes=4) == 8 + 8 / 8
    assert [zero_paper_bytes_per_parameter(s, 64) for s in range(4)] == [16, 4 + 12 / 64, 2 + 14 / 64, 16 / 64]
    # A real model at DP=8 is within 0.1% of the per-parameter rule (the rest: bucket padding, vocabulary padding).
    model = load_model_config("gpt2_medium")
    params = 354_823_168
    for zero in (0, 1, 2, 3):
        layout = Layout(dp=8, zero=zero)
        total = model_state_bytes(model, layout).total
        assert abs(total / params / bytes_per_parameter(zero, 8) - 1) < 0.002, zero


def test_hsdp_shards_over_one_instance():
    """--num-distributed-optimizer-instances N: every rank holds what DP x CP / N ranks of a plain layout hold."""
    model = load_model_config("gpt2_medium")
    for zero in (1, 2, 3):
        hsdp = model_state_bytes(model, Layout(dp=8, zero=zero, instances=4))
        assert hsdp == model_state_bytes(model, Layout(dp=2, zero=zero)), zero


def test_zero3_holds_the_paper_s_16_over_n_as_fp32_shards():
    """4 (fp32 weight shard, the main parameter) + 4 (fp32 gradient shard) + 8 (Adam) over N, whatever the model
    dtype: the ZeRO paper's total, split differently (its 2 + 2 + 12)."""
    for n in (2, 8, 64):
        assert bytes_per_parameter(3, n) == bytes_per_parameter(3, n, dtype_bytes=4) == 16 / n
        assert bytes_per_parameter(3, n) == zero_paper_bytes_per_parameter(3, n)
    model = load_model_config("gpt2_medium")
    bf16, fp32 = (model_state_bytes(model, Layout(dp=8, zero=3), dtype_bytes=d) for d in (2, 4))
    assert (bf16.weights, bf16.gradients, bf16.optimizer) == (fp32.weights, fp32.gradients, fp32.optimizer)
    assert bf16.weights == bf16.gradients == bf16.optimizer / 2
    # The last DP rank holds fewer rows where a dimension does not divide by DP (at DP 7 the 50304-row embedding is
    # cut 6 x 7187 + 7182): no rank holds more than DP rank 0, and all ranks together hold the whole model.
    ranks = [model_state_bytes(model, Layout(dp=7, zero=3), dp_rank=r).weights for r in range(7)]
    assert max(ranks) == ranks[0] > ranks[-1] and sum(ranks) == 4 * count_parameters(model).per_stage[0]
    # --optimizer muon: one 4-byte buffer for the hidden matrices' rows where Adam keeps two: in the tiny model's two
    # layers, 2 x (192 + 64 + 256 + 256) x 64 elements (qkv, projection, fc1, fc2), half on each of DP=2's ranks.
    tiny = tiny_config().model
    adam, muon = (model_state_bytes(tiny, Layout(dp=2, zero=3, muon=m)).optimizer for m in (False, True))
    assert adam - muon == 4 * 2 * 768 * 64 / 2


def test_zero3_offload_moves_the_states_to_the_host_and_leaves_the_gathered_layers():
    model = load_model_config("gpt2_medium")
    plain = model_state_bytes(model, Layout(dp=8, zero=3))
    optimizer = model_state_bytes(model, Layout(dp=8, zero=3, optimizer_cpu_offload=True))
    everything = model_state_bytes(model, Layout(dp=8, zero=3, optimizer_cpu_offload=True, offload_params=True))
    shard = plain.weights
    assert (optimizer.weights, optimizer.gradients, optimizer.optimizer) == (shard, shard, 0)
    assert optimizer.host_optimizer == 3 * shard                 # Adam and an fp32 main copy of the device shard
    assert everything.total == 0 and everything.host == 4 * shard   # the host shard is the main parameter itself
    assert plain.gathered == optimizer.gathered == everything.gathered > 0


def test_zero3_working_memory_is_the_root_unit_and_a_layer_three_times_plus_fp32_once():
    """What FSDP2 holds at the peak of a layer's backward: the root unit gathered (bf16), the output layer's
    gradient (tied: the embedding's; and the final norm's), two gathered layers, one layer's bf16 gradient and the
    previous layer's fp32 reduce-scatter input. tests/multiprocess/test_planner_zero3.py measures it on the CPU."""
    model = load_model_config("gpt2_medium")     # tied, learned positions; DP 8 divides every dimension: no padding
    h, v, positions = model.hidden_size, model.padded_vocab_size(1), model.max_positions
    layer = 12 * h * h + 13 * h
    root = v * h + positions * h + 2 * h
    expected = 2 * root + 2 * (v * h + 2 * h) + (3 * 2 + 4) * layer
    states = model_state_bytes(model, Layout(dp=8, zero=3))
    assert states.gathered == expected
    # It does not shrink with DP, nor grow with the number of layers: one layer at a time (and one prefetched).
    assert model_state_bytes(model, Layout(dp=64, zero=3)).gathered == pytest.approx(expected, rel=1e-3)
    deeper = dataclasses.replace(model, num_layers=2 * model.num_layers)
    assert model_state_bytes(deeper, Layout(dp=8, zero=3)).gathered == expected
    # The stage's total counts it once, beside the states and the activations.
    stage = stage_memory(model, Layout(dp=8, zero=3), 0, 8)
    assert stage.gathered == expected and stage.total == stage.states + stage.gathered + stage.activations
    # --zero3-prefetch-bucket-size: each layer prefetches the next ones that fit (at least one), each p bytes more
    for budget, ahead in [(1, 1), (layer, 1), (2 * layer, 2), (3 * layer - 1, 2), (10**12, model.num_layers - 1)]:
        prefetched = model_state_bytes(model, Layout(dp=8, zero=3), prefetch_bucket_size=budget).gathered
        assert prefetched == expected + (ahead - 1) * 2 * layer, budget


# ---- activations ----------------------------------------------------------------------------------------------------

def _measured_activations(model, tp: int, sequence_parallel: bool, pre: bool, post: bool, b: int) -> int:
    s, h = model.seq_length, model.hidden_size
    with parallel_state.simulated_layout(tp, 1):
        rng = TensorParallelRNG(0, 0, 0, torch.device("cpu"))
        chunk = GPTModel(model, rng, pre_process=pre, post_process=post, sequence_parallel=sequence_parallel)
        tokens = torch.randint(model.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
        first = tokens[:, :-1] if pre else torch.randn(b, s // (tp if sequence_parallel else 1), h,
                                                        requires_grad=True)

        depth = model.mtp_num_layers
        shard = shard_sequence(s, torch.device("cpu"))
        targets = multi_token_targets(tokens, depth, torch.ones(b, s), None, shard) if depth and post else None

        def step(x):   # as the trainer's forward_step: chunk, then the loss mask on the last stage
            out = chunk(x, tokens[:, 1:] if post else None, shard, mtp=targets)
            if targets is not None:
                out, mtp = out
                return (out.float() * torch.ones(b, s)).sum() + (mtp.float() * targets.loss_mask).sum()
            return (out.float() * torch.ones(b, s)).sum() if post else out

        measured, _ = saved_bytes(step, first, exclude=list(chunk.parameters()))
    return measured


@pytest.mark.parametrize("tp, sp, pre, post, b, options", [
    (1, False, True, True, 2, {}),
    (1, False, True, True, 2, {"hidden_dropout": 0.1, "attention_dropout": 0.1}),           # the math path
    (1, False, True, True, 4, {"recompute_granularity": "selective", "attention_dropout": 0.1}),
    (1, False, True, True, 2, {"recompute_granularity": "full", "recompute_method": "uniform"}),
    (1, False, True, True, 2, {"num_layers": 4, "recompute_granularity": "full", "recompute_method": "block",
                               "recompute_num_layers": 2}),
    (1, False, False, False, 2, {"hidden_dropout": 0.1}),                                   # a middle stage
    (1, False, True, False, 2, LLAMA),
    (1, False, False, True, 2, LLAMA),
    (2, False, True, True, 2, {"hidden_dropout": 0.1, "attention_dropout": 0.1}),
    (2, True, True, True, 2, {"hidden_dropout": 0.1}),
    (4, True, True, True, 2, LLAMA),                                          # TP > key/value heads: gathered
    (2, True, True, True, 2, {"recompute_granularity": "full", "recompute_method": "uniform"}),
    (1, False, True, True, 2, {"softmax_type": "learnable", "attention_dropout": 0.1}),   # the sinks' softmax
    (2, True, True, True, 2, {**LLAMA, "softmax_type": "off-by-one"}),                      # with repeated k and v
    (2, True, True, True, 2, {**LLAMA, **MODULES, "recompute_modules": "core_attn mlp layernorm"}),
    (1, False, True, True, 2, {**TINY_MOE, **MODULES, "moe_shared_expert_intermediate_size": 32,
                               "recompute_modules": "layernorm moe_act shared_experts"}),
    (1, False, True, True, 2, {**TINY_MOE, **MODULES, "recompute_modules": "core_attn moe"}),
    (2, True, False, True, 2, {**LLAMA, "mtp_num_layers": 2}),                # multi-token prediction's modules
    (1, False, True, True, 2, {**LLAMA, "mtp_num_layers": 1, "recompute_granularity": "full",
                               "recompute_method": "uniform"}),
    (2, True, True, True, 2, {**LLAMA, "swiglu": False, "gated_linear_unit": True, "sandwich_norm": True,
                              "qk_layernorm": True, "apply_layernorm_1p": True, "scale_embeddings": True}),   # Gemma
])
def test_activations_match_what_autograd_keeps(local_collectives, tp, sp, pre, post, b, options):
    model = tiny_config(model={"num_layers": 2, **options}).model
    measured = _measured_activations(model, tp, sp, pre, post, b)
    layout = Layout(tp=tp, sequence_parallel=sp, micro_batch_size=b, recompute=model.recompute_granularity)
    kept, _ = _chunk_activation_bytes(model, layout, model.num_layers, pre, post, Numerics.cpu())
    print(f"TP={tp} SP={sp} first={pre} last={post} b={b} {options}: measured {measured}, planned {kept:.0f} "
          f"(ratio {measured / kept:.5f})")
    assert abs(measured / kept - 1) < 0.15


@pytest.mark.parametrize("tp, sp, options, modules", [
    (1, False, {"hidden_dropout": 0.1, "attention_dropout": 0.1}, "attn_norm core_attn attn_proj mlp_norm"),
    (2, True, LLAMA, "core_attn attn_norm"),
    (2, True, {**LLAMA, **MODULES, "recompute_modules": "core_attn layernorm"}, "attn_norm core_attn mlp_norm"),
    (1, False, {**TINY_MOE, **MODULES, "swiglu": True, "recompute_modules": "moe_act"}, "mlp_norm expert_fc1 moe_act"),
])
def test_offloaded_bytes_leave_what_autograd_keeps_as_planned(local_collectives, tp, sp, options, modules):
    """--offload-modules: the bytes autograd keeps on the device with and without offloading, measured (what the
    offloaded parts save is handed to the offloader's hooks, whose host copies autograd keeps instead), against
    the planner's: the saving exactly, the totals within the suite's 15% (the output layer's share)."""
    layout = Layout(tp=tp, sequence_parallel=sp, micro_batch_size=2)
    bytes_of = {}
    for offload in (False, True):
        model = tiny_config(model={"num_layers": 2, **options, **({**OFFLOAD, "offload_modules": modules} if offload
                                                                   else {})}).model
        measured = _measured_activations(model, tp, sp, True, True, 2)
        planned, _ = _chunk_activation_bytes(model, dataclasses.replace(layout, recompute=model.recompute_granularity),
                                             model.num_layers, True, True, Numerics.cpu())
        bytes_of[offload] = measured, planned
    (plain, plain_planned), (offloaded, offloaded_planned) = bytes_of[False], bytes_of[True]
    print(f"TP={tp} SP={sp} offloading {modules}: measured {plain} -> {offloaded} bytes "
          f"({offloaded / plain:.3f}), planned {plain_planned:.0f} -> {offloaded_planned:.0f} "
          f"({offloaded_planned / plain_planned:.3f}); saving measured/planned "
          f"{(plain - offloaded) / (plain_planned - offloaded_planned):.4f}")
    assert offloaded < plain and abs(offloaded / offloaded_planned - 1) < 0.15
    assert plain - offloaded == pytest.approx(plain_planned - offloaded_planned, rel=1e-9)


@pytest.mark.parametrize("recipe, tp, sp, options", [
    ("tensorwise", 1, False, {}),
    ("delayed", 1, False, LLAMA),
    ("tensorwise", 2, False, {}),
    ("tensorwise", 2, True, {}),
    ("tensorwise", 2, True, {"recompute_granularity": "selective"}),   # the core keeps no output: one byte, not p
    ("rowwise", 2, True, {}),                                           # inputs and weights kept as they are
])
def test_fp8_changes_the_saved_bytes_as_planned(local_collectives, recipe, tp, sp, options):
    """FP8 linears keep their inputs in one byte and an FP8 copy of their weights: what that changes in a whole
    chunk's saved bytes against the same model without FP8 is the planner's difference to the byte (two fp32
    scales a linear included)."""
    fp8 = {"fp8_format": "hybrid", "fp8_recipe": recipe}
    models = [tiny_config(model={"num_layers": 2, **options, **extra}).model for extra in ({}, fp8)]
    layout = Layout(tp=tp, sequence_parallel=sp, micro_batch_size=2, recompute=models[0].recompute_granularity)
    measured = [_measured_activations(m, tp, sp, True, True, 2) for m in models]
    planned = [_chunk_activation_bytes(m, layout, 2, True, True, Numerics.cpu())[0] for m in models]
    print(f"FP8 {recipe} TP={tp} SP={sp} {options}: saved bytes {measured[1]} against {measured[0]}, planned "
          f"difference {planned[1] - planned[0]:.0f}")
    assert measured[1] - measured[0] == planned[1] - planned[0]
    assert (measured[1] < measured[0]) == (recipe != "rowwise")


@pytest.mark.parametrize("tp, sp, recompute", [(1, False, None), (1, False, "selective"), (2, False, None),
                                               (2, True, None), (2, True, "selective"), (2, True, "full")])
def test_layer_bytes_are_korthikanti_for_the_paper_model(tp, sp, recompute):
    """GPT layer with dropout on the CPU: the planner equals tests/activation_memory.py's adjusted Korthikanti
    formula, which the multiprocess test measures within 1% at TP=2."""
    model = tiny_config(model={"hidden_dropout": 0.1, "attention_dropout": 0.1, "recompute_granularity": recompute,
                               "recompute_method": "uniform" if recompute == "full" else None}).model
    s, b, h, a = model.seq_length, 2, model.hidden_size, model.num_attention_heads
    planned = layer_activation_bytes(model, tp, sp, b, Numerics.cpu(), recomputed=recompute == "full")
    expected = korthikanti_bytes(s, b, h, a, tp, sequence_parallel=sp, recompute=recompute, p=4, m=4)
    if recompute != "full":
        expected += layer_norm_statistics_bytes(s, b, tp, sequence_parallel=sp)
    assert planned == pytest.approx(expected)


def test_gpu_numerics_drop_the_attention_square_and_use_byte_masks():
    model = load_model_config("gpt2_medium")   # dropout 0.1
    s, b, h = model.seq_length, 1, model.hidden_size
    per_sbh = layer_activation_bytes(model, 1, False, b, Numerics.gpu()) / (s * b * h)
    # Korthikanti's 34 without the 5as/h term (flash attention), plus fp32 norm statistics and the log-sum-exp.
    assert 34 <= per_sbh < 34.1


def test_pipeline_holds_pp_micro_batches_on_the_first_stage_and_megatron_s_interleaved_factor():
    for pp in (2, 4, 8):
        assert peak_in_flight_bytes(pp, 0, 64, 1, (1.0,)) == pp                  # 1F1B: PP in flight
        assert peak_in_flight_bytes(pp, pp - 1, 64, 1, (1.0,)) == 1
        for v in (2, 4):
            chunks = peak_in_flight_bytes(pp, 0, 8 * pp, v, (1.0,) * v)          # chunk-micro-batches of L/(PP V)
            assert chunks / (pp * v) == pytest.approx(1 + (pp - 1) / (pp * v))   # x the stage's L/PP layers
    model = tiny_config(model={"num_layers": 4}).model
    layout = Layout(pp=2, micro_batch_size=2)
    kept, transient = _chunk_activation_bytes(model, layout, 2, True, False, Numerics.cpu())
    assert activation_bytes(model, layout, 0, 8, Numerics.cpu()) == 2 * kept + transient


def test_zero_bubble_holds_1f1b_s_first_stage_at_most():
    """ZB-H1 keeps every stage at PP micro-batches from F to W, those past their B holding only what W needs: the
    first stage holds what it does in 1F1B, the others more than in 1F1B but no more than the first (Qi et al.
    2023). ZB-V holds 2 PP chunk-micro-batches of half a stage each."""
    for pp in (2, 4, 8):
        one_f_one_b = [peak_in_flight_bytes(pp, r, 64, 1, (1.0,)) for r in range(pp)]
        for w in (0.0, 0.5, 1.0):   # what a micro-batch waiting for its W holds, relative to a whole one
            zb = [peak_in_flight_bytes(pp, r, 64, 1, (1.0,), "zero-bubble", (w,)) for r in range(pp)]
            assert zb[0] == one_f_one_b[0] == pp and max(zb) <= pp
            assert zb == [pp - r + r * w for r in range(pp)]
            zbv = [peak_in_flight_bytes(pp, r, 64, 2, (0.5, 0.5), "zbv", (w / 2, w / 2)) for r in range(pp)]
            assert max(zbv) <= pp
    model = tiny_config(model={"num_layers": 4}).model
    layout = Layout(pp=2, micro_batch_size=2, pipeline_schedule="zero-bubble")
    first = activation_bytes(model, layout, 0, 8, Numerics.cpu())
    assert first == pytest.approx(activation_bytes(model, Layout(pp=2, micro_batch_size=2), 0, 8, Numerics.cpu()))


def test_the_fused_masked_softmax_core_keeps_the_attention_square():
    from megalite.config.cli import parse_args
    from megalite.planner.dry_run import numerics_for
    model = load_model_config("llama2_7b")   # no dropout
    s, a = model.seq_length, model.num_attention_heads
    flash = numerics_for(parse_args(["model=llama2_7b", "data=mock", "--bf16"]), cuda=True)
    unfused = numerics_for(parse_args(["model=llama2_7b", "data=mock", "--bf16", "--use-fused-kernels", "on"]),
                           cuda=True)
    extra = layer_activation_bytes(model, 1, False, 1, unfused) - layer_activation_bytes(model, 1, False, 1, flash)
    assert extra == pytest.approx(2 * a * s * s - 4 * a * s)   # the bf16 softmax instead of the log-sum-exp
