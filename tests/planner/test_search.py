"""The layout search reproduces the published choices in the clear cases, and what it proposes runs: its command
line parses and passes megalite's own validation. Plus the step-time model's formulas."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import pytest

from megalite.config import flags
from megalite.config.cli import parse_args
from megalite.config import validate
from megalite.config.dims import ParallelDims
from megalite.pipeline import schedule_bubble
from megalite.planner import (Hardware, Layout, command_line, load_model_config, model_state_bytes, search, step_time,
                              to_json)
from megalite.planner.memory import fully_sharded_units, padded_elements
from megalite.model.flops import dense_macs_per_token_per_layer
from megalite.planner.performance import context_parallel_bytes
from megalite.planner.pipeline_balance import balanced_pipeline_split, balanced_split
from megalite.planner.search import _variants
from megalite.planner.search import estimate as estimate_layout

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt_350m_on_8():
    return search(load_model_config("gpt2_medium"), Hardware(num_gpus=8), 512, model_name="gpt2_medium")


@pytest.fixture(scope="module")
def llama_70b_on_64_nvlink():
    return search(load_model_config("llama2_70b"), Hardware(num_gpus=64), 1024, model_name="llama2_70b")


@pytest.fixture(scope="module")
def llama_70b_on_64_pcie():
    return search(load_model_config("llama2_70b"), Hardware(num_gpus=64, intra_node_link="pcie"), 1024,
                  model_name="llama2_70b")


def test_a_350m_model_on_8_gpus_of_80_gb_is_pure_data_parallel(gpt_350m_on_8):
    winner = gpt_350m_on_8.winner.layout
    assert (winner.tp, winner.pp, winner.dp) == (1, 1, 8)
    assert winner.recompute is None
    assert "pure data parallelism" in " ".join(gpt_350m_on_8.explanation)


def test_a_70b_model_on_64_nvlink_gpus_uses_tensor_parallelism_inside_the_node(llama_70b_on_64_nvlink):
    plan = llama_70b_on_64_nvlink
    winner = plan.winner.layout
    assert 2 <= winner.tp <= 8 and winner.sequence_parallel
    # DP alone fits only with ZeRO-3 (and full recompute), and is slower: its traffic crosses the network.
    pure = [e for e in plan.ranked if e.layout.tp == 1 and e.layout.pp == 1]
    assert [e.layout.zero for e in pure] == [3] and pure[0].time.step > plan.winner.time.step
    zero2 = estimate_layout(plan.model, Layout(dp=64, zero=2, recompute="full"),
                            plan.hardware, 1024)
    assert zero2.peak.states > plan.hardware.usable_memory_bytes
    assert any(r.tp == 1 and r.pp == 2 and "model states alone" in r.reason for r in plan.rejected)
    assert any(r.tp == 16 and "cross the network" in r.reason for r in plan.rejected)
    assert plan.winner.peak.total <= Hardware().usable_memory_bytes
    assert 0.3 < plan.winner.mfu(plan.hardware) < 0.5


def test_a_70b_model_without_nvlink_prefers_pipeline_or_zero_over_tensor_parallelism(llama_70b_on_64_pcie):
    winner = llama_70b_on_64_pcie.winner.layout
    assert winner.tp <= 2
    assert winner.pp > 1 or winner.zero > 0
    assert "PCIe" in " ".join(llama_70b_on_64_pcie.explanation)


def test_zero3_wins_when_the_model_must_be_sharded_and_tensor_parallelism_is_slow(llama_70b_on_64_pcie):
    """Over PCIe, TP's all-reduces cannot hide and PP pays its bubble; ZeRO-3's gathers, 8 bytes per parameter per
    micro-batch, hide behind compute once the micro-batch is large enough, which its memory savings allow."""
    plan = llama_70b_on_64_pcie
    winner = plan.winner
    assert (winner.layout.tp, winner.layout.pp, winner.layout.zero) == (1, 1, 3)
    assert winner.time.dp_exposed < 0.05 * winner.time.dp and winner.peak.gathered > 0
    why = " ".join(plan.explanation)
    assert "ZeRO-3 shards everything over the 64 GPUs" in why and "PCIe (32 GB/s)" in why
    assert "--zero-stage 3" in command_line(plan) and "--overlap-grad-reduce" not in command_line(plan)


def test_zero3_is_a_candidate_only_without_pipelining():
    assert {lay.zero for lay in _variants(ParallelDims(8, tp=2), 1, 64)} == {0, 1, 2, 3}           # DP 4
    assert {lay.zero for lay in _variants(ParallelDims(16, tp=2, pp=2), 1, 64)} == {0, 1, 2}      # DP 4
    assert {lay.zero for lay in _variants(ParallelDims(8, tp=8), 1, 64)} == {0}     # nothing to shard over


@pytest.mark.parametrize("layout", [
    Layout(dp=4, zero=3),
    Layout(tp=2, dp=2, zero=3, sequence_parallel=True, recompute="full", micro_batch_size=2),
    Layout(dp=4, zero=3, optimizer_cpu_offload=True),
    Layout(dp=4, zero=3, optimizer_cpu_offload=True, offload_params=True),
    Layout(dp=4, zero=2, optimizer_cpu_offload=True),
    Layout(pp=2, dp=2, zero=1),
    Layout(tp=2, cp=2, dp=2, zero=1, sequence_parallel=True, cp_comm_type="allgather"),
    Layout(cp=4, dp=2, zero=3, cp_comm_type="a2a"),
    Layout(tp=2, dp=4, zero=3, instances=2),
])
def test_a_layout_round_trips_through_megalite_s_parser(layout):
    """argv() -> pretrain_gpt.py's parser and validation -> from_config gives the layout back (and the same config
    spelled as Hydra overrides)."""
    words = ["model=gpt_tiny", "data=mock", "--global-batch-size", "16"]
    base = parse_args(words)
    cfg = parse_args(words + layout.argv(base))
    validate(cfg, layout.world_size)
    assert Layout.from_config(cfg, layout.world_size) == layout
    assert parse_args(words + [flags.override(k, v) for k, v in flags.differences(cfg, base).items()]) == cfg
    assert cfg.optimizer.overlap_grad_reduce == (layout.zero in (0, 1, 2))


def test_context_parallelism_wins_for_long_sequences_only():
    """Llama 2 7B at 128k tokens on 8 GPUs: without CP even full recompute leaves the activations too big; with it
    they split over the CP ranks. At 4k (the fixtures above) CP is not even searched."""
    model = dataclasses.replace(load_model_config("llama2_7b"), seq_length=131072, max_position_embeddings=131072)
    plan = search(model, Hardware(num_gpus=8), 8, model_name="llama2_7b")
    winner = plan.winner
    assert winner.layout.cp > 1 and winner.time.cp > 0
    assert f"CP={winner.layout.cp} splits each sample's 131,072 tokens" in plan.explanation[1]
    without = estimate_layout(model, dataclasses.replace(winner.layout, cp=1, dp=winner.layout.replicas),
                              Hardware(num_gpus=8), 8)
    assert not without.fits
    # CP shrinks the activations, not the model states.
    assert winner.peak.activations == pytest.approx(without.peak.activations / winner.layout.cp, rel=0.05)


def test_ring_traffic_is_the_key_value_blocks_around_the_ring():
    """Per layer and micro-batch: (CP-1) K/V blocks of the rank's tokens forward; backward (CP-1) blocks and CP fp32
    dK/dV accumulators (the counted bytes are checked against a real run in tests/multiprocess)."""
    model = load_model_config("llama2_7b")
    s, kv = model.seq_length // 4, 2 * model.seq_length // 4 * model.hidden_size   # no grouping: G d = h
    sent = context_parallel_bytes(model, Layout(cp=4), 2)
    assert sent == {"forward": 3 * kv * 2, "backward": 3 * kv * 2 + 4 * kv * 4} and s == 1024
    assert context_parallel_bytes(model, Layout(cp=1), 2) == {"forward": 0.0, "backward": 0.0}


@pytest.mark.parametrize("plan_name", ["gpt_350m_on_8", "llama_70b_on_64_nvlink", "llama_70b_on_64_pcie"])
def test_the_proposed_command_runs_megalite_s_validation(plan_name, request):
    plan = request.getfixturevalue(plan_name)
    for estimate in plan.ranked[:3]:
        words = shlex.split(command_line(plan, estimate).replace("$MASTER_ADDR", "host"))
        argv = words[words.index("pretrain_gpt.py") + 1:]
        cfg = parse_args(argv + ["data=mock"])
        validate(cfg, plan.hardware.num_gpus)
        assert Layout.from_config(cfg, plan.hardware.num_gpus) == estimate.layout
        assert cfg.model == estimate.layout.model_config(plan.model)
        entry = to_json(plan)["ranked"][plan.ranked.index(estimate)]
        assert parse_args(entry["hydra_overrides"] + ["data=mock"]) == cfg   # the Hydra spelling too


def test_json_has_the_table_the_reasons_and_the_command(llama_70b_on_64_nvlink):
    data = json.loads(json.dumps(to_json(llama_70b_on_64_nvlink)))
    first = data["ranked"][0]
    assert {"weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes"} <= first["memory"].keys()
    assert {"tp", "pp", "dp", "dp_exposed"} <= first["communication_s"].keys()
    lay = first["layout"]
    assert first["bubble"] == pytest.approx(schedule_bubble(lay["pipeline_schedule"], lay["pp"], 1024 // (
        lay["dp"] * lay["micro_batch_size"]), lay["virtual_stages"]))
    assert data["parameters"]["total"] == 68_976_648_192
    assert len(data["why"]) == 3 and data["rejected"] and data["command"].startswith("torchrun --nnodes 8")


def test_nothing_fits_says_so():
    plan = search(load_model_config("llama2_70b"), Hardware(num_gpus=8, gpu_memory_gib=24), 64)
    assert plan.winner is None and "No layout fits" in plan.explanation[0]


def test_the_command_line_tool(capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    import plan_parallelism
    code = plan_parallelism.main(["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
                                  "--vocab-size", "1000", "--seq-length", "128", "--gpus", "2",
                                  "--global-batch-size", "16", "normalization=RMSNorm", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["model"]["normalization"] == "RMSNorm" and data["model"]["seq_length"] == 128
    assert "--normalization RMSNorm" in data["command"] and "--seq-length 128" in data["command"]
    assert plan_parallelism.main(["--model", "gpt2_small", "--gpus", "8", "--global-batch-size", "64"]) == 0
    text = capsys.readouterr().out
    assert "Why: " in text and "torchrun --nproc_per_node 8 pretrain_gpt.py model=gpt2_small" in text
    assert plan_parallelism.main(["--model", "nope"]) == 2


def test_the_command_line_tool_with_a_deepspeed_config(capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    import plan_parallelism
    configs = ROOT / "tests" / "config" / "deepspeed_configs"
    argv = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--vocab-size", "1000",
            "--seq-length", "128", "--gpus", "4", "--deepspeed-config", str(configs / "zero3_offload_finetune.json")]
    assert plan_parallelism.main(argv + ["--global-batch-size", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    written = data["deepspeed_config"]["as_written"]
    assert data["global_batch_size"] == 64 and written["layout"]["dp"] == 4 and written["layout"]["zero"] == 3
    assert written["layout"]["optimizer_cpu_offload"] and written["layout"]["offload_params"]
    assert written["memory"]["host_optimizer_bytes"] > 0 and written["fits"]
    assert data["deepspeed_config"]["table"][0].endswith("0 refused (the command line wins over the file)")
    assert plan_parallelism.main(argv) == 0   # the batch "auto": the tool's 512
    text = capsys.readouterr().out
    assert "as written (TP=1 x PP=1 x DP=4, micro-batch 2, ZeRO-3+offload+params)" in text
    assert "Alternatives for the same model, batch and precision:" in text and "global batch 512" in text
    argv[-1] = str(configs / "zero_infinity_nvme.json")
    assert plan_parallelism.main(argv) == 2
    captured = capsys.readouterr()
    assert "2 refused" in captured.out and "offload_param.device=nvme" in captured.err


# ---- the step-time model ---------------------------------------------------------------------------------------------

def test_tensor_parallel_traffic_is_8bsh_times_t_minus_1_over_t():
    model = load_model_config("gpt2_medium", num_layers=1)
    hardware = Hardware(num_gpus=8, intra_node_gbps=1.0)   # 1 GB/s: seconds = gigabytes
    for tp in (2, 4, 8):
        layout = Layout(tp=tp, dp=8 // tp, micro_batch_size=1)
        time = step_time(model, layout, hardware, 8 // tp)   # one micro-batch
        b, s, h = 1, model.seq_length, model.hidden_size
        per_layer = 8 * b * s * h * (tp - 1) / tp * 2 / 1e9   # bf16 elements
        ends = 2 * 2 * b * s * h * (tp - 1) / tp * 2 / 1e9    # the embedding's and the output layer's all-reduce
        assert time.tp == pytest.approx(per_layer + ends)
        sequence_parallel = step_time(model, Layout(tp=tp, dp=8 // tp, sequence_parallel=True), hardware, 8 // tp)
        assert sequence_parallel.tp == pytest.approx(per_layer * 10 / 8 + ends)


def test_fp8_linears_at_the_fp8_rate_and_their_gathers_in_one_byte():
    """--fp8-format: the linears' FLOPs at twice the rate on Hopper (the attention core and output layer not), none
    on a device without FP8 (ratio 1); under sequence parallelism the column-parallel gathers move FP8."""
    model = load_model_config("gpt2_medium", num_layers=1)
    fp8 = dataclasses.replace(model, fp8_format="hybrid", fp8_recipe="tensorwise")
    layout = Layout(tp=2, dp=4, micro_batch_size=1, sequence_parallel=True)
    hardware = Hardware(num_gpus=8, intra_node_gbps=1.0)
    bf16_time, fp8_time = (step_time(m, layout, hardware, 4) for m in (model, fp8))
    b, s, h = 1, model.seq_length, model.hidden_size
    dense = 6.0 * b * s * dense_macs_per_token_per_layer(model) / (2 * hardware.peak_flops * hardware.efficiency)
    assert bf16_time.compute - fp8_time.compute == pytest.approx(dense / 2)
    assert step_time(fp8, layout, Hardware(num_gpus=8, fp8_peak_ratio=1.0), 4).compute == pytest.approx(
        step_time(model, layout, Hardware(num_gpus=8), 4).compute)
    per_unit = b * s * h * 1 / 2 * 2 / 1e9   # b s h bf16 elements x (t-1)/t, in seconds at 1 GB/s
    assert bf16_time.tp - fp8_time.tp == pytest.approx(2 * per_unit)   # 4 of the 10 units at half the bytes


def test_fp8_param_gather_gathers_the_fp8_linears_weights_in_one_byte():
    """--fp8-param-gather: the distributed optimizer's parameter all-gather moves the FP8 linears' weight buckets in
    one byte an element instead of two, the rest in bf16, and so do ZeRO-3's per-micro-batch gathers; the
    reduce-scatters of fp32 gradients are unchanged."""
    from megalite.planner.performance import fp8_gathered_elements   # noqa: PLC0415

    model = dataclasses.replace(load_model_config("gpt2_medium"), fp8_format="hybrid")
    gathered = dataclasses.replace(model, fp8_param_gather=True)
    layout = Layout(dp=8, zero=1)
    hardware = Hardware(num_gpus=8, intra_node_gbps=1.0)   # 1 GB/s: seconds = gigabytes
    fp8 = fp8_gathered_elements(gathered, layout)
    layers = 24 * 12 * model.hidden_size ** 2   # qkv, proj, fc1, fc2 of 24 layers (4h MLP)
    assert fp8 == pytest.approx(layers, rel=1e-3) and fp8_gathered_elements(model, layout) == 0
    saved = step_time(model, layout, hardware, 8 * 4).dp - step_time(gathered, layout, hardware, 8 * 4).dp
    assert saved == pytest.approx(fp8 * 7 / 8 / 1e9)   # one byte an element less, (n-1)/n of it on the ring
    # ZeRO-3: every micro-batch gathers each layer twice (forward, backward), its FP8 weights one byte lighter.
    zero3 = Layout(dp=8, zero=3)
    saved = step_time(model, zero3, hardware, 8 * 4).dp - step_time(gathered, zero3, hardware, 8 * 4).dp
    assert saved == pytest.approx(4 * 2 * layers * 7 / 8 / 1e9)


def test_zero3_moves_the_parameters_three_times_per_micro_batch():
    """Forward and backward all-gathers in bf16 (the root unit once: FSDP2 keeps it through the backward) and an fp32
    reduce-scatter, every micro-batch: 2 x 2 + 4 bytes per parameter where ZeRO-1 moves 4 + 2 per step."""
    model = load_model_config("gpt2_medium")
    hardware = Hardware(num_gpus=8, intra_node_gbps=1.0)   # 1 GB/s: seconds = gigabytes
    units = fully_sharded_units(model, 1)
    root = sum(padded_elements(u, 8) for u in units.roots)
    layers = sum(padded_elements(u, 8) for u in units.layers)
    per_micro_batch = (2 * (root + layers) + 2 * layers + 4 * (root + layers)) * 7 / 8 / 1e9
    zero3 = step_time(model, Layout(dp=8, zero=3), hardware, 8 * 4)    # 4 micro-batches
    assert zero3.dp == pytest.approx(4 * per_micro_batch)
    zero1 = step_time(model, Layout(dp=8, zero=1), hardware, 8 * 4)
    assert 5 < zero3.dp / zero1.dp < 4 * 8 / 6                              # M x (2p + 4) / (p + 4), less the root
    # On a slow link little hides; on a fast one only the ends of each micro-batch show.
    assert 0.5 * zero3.dp < zero3.dp_exposed <= zero3.dp
    fast = step_time(model, Layout(dp=8, zero=3), Hardware(num_gpus=8), 8 * 4)
    assert fast.dp_exposed < 0.3 * fast.dp and fast.step < zero3.step


def test_hsdp_reduces_inside_the_node_and_all_reduces_the_shards_across():
    """DP=16 over 2 nodes of 8 at ZeRO-1: flat, the reduce-scatter and the gather of all 16 ranks run at the network's
    speed; as 2 instances of 8 (HSDP) they stay on the node's links, and only the reduced shards, 4/8 bytes per
    parameter, cross the network in an all-reduce of 2."""
    model = load_model_config("gpt2_medium")
    hardware = Hardware(num_gpus=16, intra_node_gbps=10.0, inter_node_gbitps=8.0)   # 10 GB/s inside, 1 GB/s across
    elements = model_state_bytes(model, Layout(dp=8, zero=1)).weights / 2   # the padded bf16 flat buffer at 8
    hsdp = step_time(model, Layout(dp=16, zero=1, instances=2), hardware, 16 * 4)
    inside = 7 / 8 * (elements * 4 + elements * 2) / 10e9   # fp32 reduce-scatter, bf16 gather
    across = 2 * (1 / 2) * elements * 4 / 8 / 1e9           # all-reduce over 2 of each rank's 1/8 shard
    assert hsdp.dp == pytest.approx(inside + across)
    flat = step_time(model, Layout(dp=16, zero=1), hardware, 16 * 4)
    assert hsdp.dp < flat.dp / 3
    zero3 = step_time(model, Layout(dp=16, zero=3, instances=2), hardware, 16 * 4)
    assert zero3.dp < step_time(model, Layout(dp=16, zero=3), hardware, 16 * 4).dp / 3


def test_bubble_and_interleaving():
    model = load_model_config("gpt_1_3b")
    hardware = Hardware(num_gpus=8)
    plain = step_time(model, Layout(pp=4, dp=2, micro_batch_size=1), hardware, 64)
    interleaved = step_time(model, Layout(pp=4, dp=2, virtual_stages=2, micro_batch_size=1), hardware, 64)
    assert plain.bubble == pytest.approx(3 / 32) and interleaved.bubble == pytest.approx(3 / 64)
    assert interleaved.bubble_time < plain.bubble_time
    # The zero-bubble schedules: a third of 1F1B's bubble, ZB-V half of that again (Qi et al. 2023).
    zb = step_time(model, Layout(pp=4, dp=2, micro_batch_size=1, pipeline_schedule="zero-bubble"), hardware, 64)
    zbv = step_time(model, Layout(pp=4, dp=2, virtual_stages=2, micro_batch_size=1, pipeline_schedule="zbv"),
                    hardware, 64)
    assert zb.bubble == pytest.approx(3 / 96) and zbv.bubble == pytest.approx(3 / 192)
    assert zbv.step < zb.step < plain.step


def test_layer_counts_pp_does_not_divide_get_the_balanced_uneven_split():
    # DeepSeek-V3's 61 layers over 8 stages, its output layer costing ~1.5 layers: the slowest stage holds 8 layers,
    # the last 6 beside the output layer and the first the rest (the most micro-batches in flight under 1F1B).
    assert balanced_split([1.0] * 61, 8, head=1.5) == (7, 8, 8, 8, 8, 8, 8, 6)
    assert balanced_split([1.0] * 6, 4) == (1, 1, 2, 2)
    assert balanced_split([1.0, 1.0, 1.0, 10.0], 3) == (1, 2, 1)   # an expensive layer gets a stage of its own
    plan = search(load_model_config("gpt_tiny", num_layers=6), Hardware(num_gpus=4), 16)
    uneven = next(e.layout for e in plan.ranked if e.layout.pp == 4)
    assert uneven.split == balanced_pipeline_split(plan.model, 4) and sum(uneven.split) == 6
    # It runs as Megatron's layout string and reads back the same.
    words = ["model=gpt_tiny", "data=mock", "--global-batch-size", "16", "--num-layers", "6"]
    cfg = parse_args(words + uneven.argv(parse_args(words)))
    assert cfg.parallel.pipeline_model_parallel_layout.startswith("Et|")
    validate(cfg, 4)
    assert Layout.from_config(cfg, 4) == uneven


def test_hierarchical_context_parallelism_is_searched_with_its_all_to_all_inside_a_node():
    """a2a+p2p is tried at every all-to-all size A from 2 to CP / 2 whose TP x A GPUs fit in a node. Where a2a
    cannot run (GPT-2 large's 20 heads do not split over 16 ranks) and CP = 16 spans two nodes on Ethernet, the
    all-to-all over NVLink and a ring of 4 over the network beat the ring of 16."""
    from megalite.planner.search import _context_exchanges   # noqa: PLC0415
    assert _context_exchanges(1, 16, 8) == [("p2p", 1), ("a2a", 1), ("a2a+p2p", 2), ("a2a+p2p", 4),
                                            ("a2a+p2p", 8)]
    assert _context_exchanges(4, 16, 8) == [("p2p", 1), ("a2a", 1), ("a2a+p2p", 2)]
    assert _context_exchanges(2, 1, 8) == [("p2p", 1)]
    model = dataclasses.replace(load_model_config("gpt2_large"), seq_length=262144, max_position_embeddings=262144,
                                num_layers=32, recompute_granularity="full", recompute_method="uniform",
                                recompute_num_layers=1)
    hardware = Hardware(num_gpus=16, inter_node_network="ethernet")
    ring, hierarchical = (estimate_layout(model, Layout(cp=16, cp_comm_type=kind, cp_a2a=a, recompute="full"),
                                          hardware, 1) for kind, a in (("p2p", 1), ("a2a+p2p", 4)))
    assert hierarchical.time.cp_exposed < ring.time.cp_exposed / 2
    assert hierarchical.time.step < ring.time.step
    layouts = list(_variants(ParallelDims(16, 1, 16, 1), 1, 1, gpus_per_node=8))
    assert {(lay.cp_comm_type, lay.cp_a2a) for lay in layouts} >= {("a2a+p2p", 2), ("a2a+p2p", 4), ("a2a+p2p", 8)}
