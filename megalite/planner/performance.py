"""Step time of a layout: compute, the pipeline bubble, and the communication that does not hide behind compute.

FLOPs: the model's (megalite/model/flops.py, Korthikanti et al. 2022 for this architecture), plus recompute, which
MFU does not count: full recompute reruns every layer's forward (x 4/3 on the layers), selective only the attention
core (4 L s^2 h B).

Time per micro-batch on a GPU of the slowest pipeline stage: its FLOPs / (TP x peak x efficiency), plus the
tensor-parallel and pipeline transfers, which megalite does not overlap with compute. A step is M of those plus the
pipeline bubble, the schedule's bubble fraction of them (megalite.pipeline.simulation.schedule_bubble, at equal
forward, input-gradient and weight-gradient costs: (PP - 1) / (V M) for 1F1B, Narayanan et al. 2021; a third of
that for the zero-bubble schedules, (PP - 1) / (6 M) for ZB-V, Qi et al. 2023), plus the part of the data-parallel
reduction that does not hide behind backward.

Communication (ring collectives over n ranks: all-reduce 2(n-1)/n x bytes / bandwidth, reduce-scatter and
all-gather (n-1)/n x bytes / bandwidth; a group uses the slowest link it spans: inside a node when its ranks fit in
one, else the network):

- TP, per layer and micro-batch: 2 all-reduces forward and 2 backward of b s h activations (Shoeybi et al. 2019),
  8 b s h (t-1)/t elements (Narayanan et al. 2021). Sequence parallelism turns each into an all-gather and a
  reduce-scatter (the same volume) but megalite's column-parallel linears all-gather their input again in backward
  for the weight gradient (not keeping it saves activation memory): 10 b s h (t-1)/t. Full recompute repeats the
  forward's 4 b s h (t-1)/t. The embedding adds one all-reduce forward and the output layer one backward. With G < t
  key/value heads, the r = t/G ranks sharing one gather its [k; v] (2 b s d elements) over those r ranks forward
  and reduce-scatter its gradient backward, (r-1)/r of each (again forward under full recompute).
- PP, per micro-batch and model chunk: the activation forward and its gradient backward, b s h (/ t with sequence
  parallelism) each, to the neighbouring stage.
- DP, per step: megalite reduces fp32 gradients: an all-reduce of 4 bytes per parameter (plain DP), or a
  reduce-scatter of them and an all-gather of the updated bf16 parameters (distributed optimizer; with
  --fp8-param-gather the FP8 linears' weights in one byte); ZeRO-2
  reduce-scatters in every micro-batch (M times the traffic). With --overlap-grad-reduce (always proposed) the
  reduction runs during the last micro-batch's backward and only the last bucket, or what exceeds that backward,
  shows; ZeRO-2's per-micro-batch reductions hide behind the whole backward; with --overlap-param-gather the
  gather hides behind the next forward. A tied embedding split across stages adds one unhidden all-reduce of its
  gradient between the first and last stage. HSDP (--num-distributed-optimizer-instances N, Megatron's two-level
  reduction): the reduce-scatter and the gather run over one instance's DP x CP / N adjacent ranks (inside a node
  when they fit), and each reduced shard, 4 / (DP x CP / N) bytes per parameter, is all-reduced over the N
  instances on the slowest link the DP x CP ranks span; at ZeRO-3 after every unit's reduce-scatter.
- ZeRO-3 (FSDP2), per micro-batch, not per step: each layer's parameters are all-gathered in the compute dtype (the
  FP8 linears' weights in one byte with --fp8-param-gather) for
  its forward and again for its backward, and its fp32 gradients reduce-scattered after it (the root unit,
  embeddings and output layer, is gathered once: FSDP2 keeps it through the backward). That is 2p + 4 bytes per
  parameter per micro-batch where ZeRO-1 moves 4 + p per step: the paper's 3x against 2x parameters, times M.
  FSDP2 prefetches one unit ahead, so a layer's gather hides behind the previous layer's forward, and in backward the
  next gather and the previous reduce-scatter behind the layer's backward; what exceeds that compute shows, and so
  do, in every micro-batch, the root's and the first layer's gathers (nothing runs before them) and the first
  layer's and the root's reduce-scatters (nothing runs after them: FSDP2 waits for them as the backward ends).

- CP (context parallelism), per layer and micro-batch, on a rank holding s / CP tokens of each sample (everything
  else above then moves and computes s / CP tokens' worth; the attention core computes its queries against all s
  keys): p2p sends the rank's K/V block (2 b (s/CP) G d / t elements) CP - 1 times forward, and backward CP - 1 K/V
  blocks plus CP fp32 dK/dV accumulators, each transfer overlapping one block's compute (a 1/CP share of the core's
  forward or backward): what exceeds it shows, and the last dK/dV transfer. a2a moves (CP-1)/CP of q, [k; v] and the
  output per pass; allgather gathers K/V forward and reduce-scatters their gradient backward; neither overlaps.
  Recompute reruns the core's forward communication. The DP reduction runs over DP x CP. The ring's blocks are
  unfused attention on a GPU, counted 3x slower than the flash kernel the other cores use
  (UNFUSED_ATTENTION_SLOWDOWN).

FP8 (``--fp8-format``): the attention and MLP linears' products run at the device's FP8 rate (Hopper: twice its
bf16 peak, ``Hardware.fp8_peak_ratio``), the attention core and the output layer at bf16's; under sequence
parallelism the column-parallel inputs are gathered in FP8 (one byte an element). The quantization passes
(memory-bound) are not counted, nor FP8's smaller saved activations in the memory estimate.

Muon (``--optimizer muon``), after the backward, not hidden (:func:`muon_step_cost`): Newton-Schulz's products and
its communication. One quintic step on an m x n matrix with Gram side g (the smaller, g <= n = the other) computes
A = X X^T (g g n multiply-adds), cA^2 + bA (g^3) and (...) X (g g n): 2 (2 g^2 n + g^3) FLOPs, times
--muon-num-ns-steps, for each matrix (q, k and v apart unless --muon-no-split-qkv), in fp32 on TF32 tensor cores
(half the bf16 peak on Ampere and Hopper, TF32_PEAK_RATIO). A matrix split over TP: ``duplicated`` all-gathers the
fp32 update over TP and runs NS on the whole matrix; ``distributed`` keeps the Gram side whole (the unsplit one),
runs the long side's products on the shard (n / TP) and all-reduces the g x g Gram matrix each step (and the norm
once); ``blockwise`` runs NS on the shard alone. Under the distributed optimizer (ZeRO-1/2) each matrix is owned by
one DP rank (megalite.optimizer.muon.owners, by size): the busiest owner's work counts, and each bucket holding
matrices is all-gathered and reduce-scattered in fp32 over DP; under ZeRO-3 two all-to-alls move each rank's rows
to the owners and back (the largest a rank sends or receives counts, at the DP group's bandwidth). Without them every
DP rank orthogonalizes every matrix. The routed experts' matrices are owned over the expert-data-parallel ranks.

Not modelled: kernel efficiency changing with matrix sizes (one efficiency for all), AdamW's step (memory-bound,
small next to a step; with CPU offload it is the host's Adam, and --offload-params adds host-device copies of every
shard), stragglers and network contention between groups (ZeRO-3's gathers share the links with
TP's all-reduces).
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config import ModelConfig
from megalite.distributed.data_parallel import default_bucket_size
from megalite.model.flops import core_width, macs_per_token_per_layer, model_flops_per_iteration
from megalite.optimizer.muon import owners
from megalite.pipeline.partition import chunks_of_rank
from megalite.pipeline.simulation import schedule_bubble
from megalite.planner.hardware import Hardware
from megalite.planner.layout import Layout
from megalite.planner.memory import (engine_buckets, fully_sharded_units, is_muon_matrix, model_state_bytes,
                                     padded_elements, shard_rows)
from megalite.planner.parameters import Tensor, rank_tensors


# megalite's ring attention on a GPU computes each block with unfused torch ops (q k^T, softmax, times v, the scores
# written to memory), which run about 3x slower than a fused flash-attention kernel (Dao et al. 2022, FlashAttention:
# up to 3x over PyTorch's standard attention on GPT-2): its FLOPs are counted at a third of the kernels' efficiency.
UNFUSED_ATTENTION_SLOWDOWN = 3.0

# Muon's Newton-Schulz runs in fp32, which megalite lets CUDA compute on TF32 tensor cores (allow_tf32): their dense
# peak is half of bf16's on A100 (156 / 312 TFLOP/s) and H100 SXM (495 / 989).
TF32_PEAK_RATIO = 0.5


def ring_all_reduce_time(num_bytes: float, n: int, bandwidth: float) -> float:
    return 2 * (n - 1) / n * num_bytes / bandwidth if n > 1 else 0.0


def ring_gather_time(num_bytes: float, n: int, bandwidth: float) -> float:
    """All-gather or reduce-scatter of a buffer of ``num_bytes`` (the whole, not one shard)."""
    return (n - 1) / n * num_bytes / bandwidth if n > 1 else 0.0


@dataclass(frozen=True)
class StepTime:
    compute: float           # seconds of compute per step on the slowest stage, bubble excluded
    tp: float                # tensor-parallel communication per step (not hidden)
    pp: float                # pipeline transfers per step (not hidden)
    dp: float                # data-parallel communication per step, total
    dp_exposed: float        # ... the part that does not hide behind compute
    bubble: float            # the schedule's bubble fraction: (PP - 1) / (V M) for 1F1B
    bubble_time: float       # seconds the slowest stage idles in the bubble
    recompute: float         # seconds of recomputed forward per step (included in compute)
    imbalance: float         # seconds per step the slowest stage computes beyond the stages' mean
    step: float              # seconds per iteration
    model_flops: float       # per iteration
    cp: float = 0.0          # context-parallel communication per step, total (the ring's partly hidden)
    cp_exposed: float = 0.0  # ... the part that does not hide behind the attention blocks' compute
    all_to_all: float = 0.0  # expert-parallel token dispatch per step (not hidden)
    muon: float = 0.0        # Muon's Newton-Schulz and its communication per step (not hidden)

    def tokens_per_second(self, global_batch_size: int, seq_length: int) -> float:
        return global_batch_size * seq_length / self.step

    def mfu(self, hardware: Hardware) -> float:
        return self.model_flops / (self.step * hardware.num_gpus * hardware.peak_flops)


def step_time(model: ModelConfig, layout: Layout, hardware: Hardware, global_batch_size: int,
              dtype_bytes: int = 2) -> StepTime:
    """Estimated seconds per iteration of ``layout`` (see the module docstring)."""
    model = layout.model_config(model) if layout.recompute != model.recompute_granularity else model
    tp, pp, v, b = layout.tp, layout.pp, layout.virtual_stages, layout.micro_batch_size
    whole, h = model.seq_length, model.hidden_size
    s = whole // layout.cp                                 # this rank's tokens of each sample
    m = layout.num_micro_batches(global_batch_size)
    p = dtype_bytes
    sp_share = 1 / tp if layout.sequence_parallel else 1.0
    rate = tp * hardware.peak_flops * hardware.efficiency   # FLOP/s of one TP group

    # Compute per micro-batch of each layer (of its active parameters: an MoE layer's tokens go through k experts)
    # and of the output layer, on one TP group (under CP: the rank's tokens, their queries against the whole
    # sequence's keys, an equal share of the causal work with the load balance).
    core_flops = 6.0 * b * s * whole * core_width(model)   # the attention core, forward and backward
    ring = layout.cp > 1 and layout.cp_comm_type in ("p2p", "a2a+p2p")
    core_time_flops = core_flops * (UNFUSED_ATTENTION_SLOWDOWN if ring else 1.0)   # the ring's blocks are unfused

    def flops_of(index: int) -> tuple[float, float]:
        """(FLOPs of layer ``index`` per micro-batch, recompute included; of which recompute), in bf16 time: with
        --fp8-format a dense layer's linears count 1 / fp8_peak_ratio (MoE experts stay bf16)."""
        linears = 6.0 * b * s * macs_per_token_per_layer(model, index)
        if model.fp8_format is not None and not moe[index]:
            linears /= hardware.fp8_peak_ratio
        flops = linears + core_time_flops
        recompute = {"full": flops / 3, "selective": core_time_flops / 3}.get(model.recompute_granularity, 0.0)
        return flops + recompute, recompute

    cp_total, cp_exposed = context_parallel_layer_time(model, layout, hardware, core_time_flops / rate, p)

    output_flops = 6.0 * b * s * model.padded_vocab_size(tp) * h
    moe = model.moe_layers()

    # Tensor-parallel bytes per layer per micro-batch (in units of b s h elements x (t-1)/t): a dense layer 8 (10
    # with sequence parallelism; + 4 recomputed); an MoE layer has attention's half, the all-reduce of its k b s h
    # expert outputs forward and of their input gradients backward (experts split over TP), its shared expert's
    # half, and under sequence parallelism the gather of its input and of its output's gradient.
    tp_bw, act = hardware.bandwidth(tp), b * s * h * p
    dense_units = 10 if layout.sequence_parallel else 8
    if layout.sequence_parallel and model.fp8_format is not None:
        # The column-parallel inputs travel in FP8, half the bytes: the two forward gathers, and the two backward
        # re-gathers unless rowwise (which re-gathers bf16 for the weight gradient's per-column scales).
        dense_units -= 1 if model.fp8_recipe == "rowwise" else 2
    if model.recompute_granularity == "full":
        dense_units += 4
    half = dense_units / 2
    moe_units = half + (4 * model.moe_router_topk if layout.expert_tp > 1 else 0) + \
        (half if model.moe_shared_expert_intermediate_size else 0) + (2 if layout.sequence_parallel else 0)

    # A key/value head split over TP/G ranks is gathered among those ranks, in forward and backward (and again when
    # recomputed): every layer's attention.
    sharing = max(tp // model.query_groups, 1)   # ranks sharing a key/value head
    kv_gathers = 3 if model.recompute_granularity == "full" else 2
    kv_time = kv_gathers * ring_gather_time(kv_head_gather_elements(model, layout) * p, sharing,
                                            hardware.bandwidth(sharing))

    def tp_time_of(index: int) -> float:
        units = moe_units if moe[index] else dense_units
        return units * (tp - 1) / tp * act / tp_bw + kv_time if tp > 1 else 0.0

    tp_end = 2 * (tp - 1) / tp * act / tp_bw if tp > 1 else 0.0   # embedding forward / output layer backward
    a2a = all_to_all_bytes(model, layout, 1, p) / max(1, sum(moe)) / hardware.bandwidth(tp * layout.ep)

    pp_message = act * sp_share / hardware.bandwidth(hardware.num_gpus) if pp > 1 else 0.0

    slowest_compute = slowest_slot = slowest_tp = slowest_recompute = total_compute = slowest_a2a = 0.0
    slowest_layers = 0
    for rank in range(pp):
        compute = tp_time = recompute = a2a_time = 0.0
        layers = 0
        for chunk in chunks_of_rank(layout.split or model.num_layers, pp, v, rank, layout.placement):
            layers += chunk.num_layers
            for index in range(chunk.first_layer, chunk.first_layer + chunk.num_layers):
                flops, recomputed = flops_of(index)
                compute += flops / rate
                recompute += recomputed / rate
                tp_time += tp_time_of(index)
                a2a_time += a2a if moe[index] else 0.0
            tp_time += (tp_end if chunk.is_first else 0.0) + (tp_end if chunk.is_last else 0.0)
            if chunk.is_last:
                compute += output_flops / rate
        total_compute += compute
        slot = compute + tp_time + a2a_time + layers * cp_exposed + 2 * v * pp_message
        if slot > slowest_slot:
            slowest_compute, slowest_slot, slowest_tp, slowest_recompute = compute, slot, tp_time, recompute
            slowest_a2a, slowest_layers = a2a_time, layers
    bubble = schedule_bubble(layout.pipeline_schedule, pp, m, v)
    pipeline = slowest_slot * m * (1 + bubble)

    if layout.zero == 3:   # modelled at PP = 1 (what the search proposes): one stage, layers like the first
        layer_flops, recompute_flops = flops_of(0)
        layer_forward = (layer_flops - recompute_flops) / 3 / rate
        dp_total, dp_exposed = _fully_sharded_time(model, layout, hardware, m, layer_forward,
                                                   layer_flops / rate - layer_forward, dtype_bytes)
    else:
        dp_total, dp_exposed = _data_parallel_time(model, layout, hardware, m, slowest_compute, dtype_bytes)
    muon = muon_step_cost(model, layout, hardware).seconds if layout.muon else 0.0
    step = pipeline + dp_exposed + muon
    return StepTime(compute=slowest_compute * m, tp=slowest_tp * m, pp=2 * v * pp_message * m, dp=dp_total,
                    dp_exposed=dp_exposed, bubble=bubble, bubble_time=slowest_slot * m * bubble,
                    recompute=slowest_recompute * m, imbalance=(slowest_compute - total_compute / pp) * m, step=step,
                    model_flops=model_flops_per_iteration(model, global_batch_size),
                    cp=slowest_layers * cp_total * m, cp_exposed=slowest_layers * cp_exposed * m,
                    all_to_all=slowest_a2a * m, muon=muon)


def kv_head_gather_elements(model: ModelConfig, layout: Layout) -> int:
    """Elements of the [k; v] of one key/value head that the TP/G ranks sharing it gather, per layer and micro-batch
    (forward; backward reduce-scatters as many): 2 b s d, or 0 when G >= TP and no head is shared."""
    if layout.tp <= model.query_groups:
        return 0
    return 2 * layout.micro_batch_size * (model.seq_length // layout.cp) * model.head_dim


def context_parallel_bytes(model: ModelConfig, layout: Layout, dtype_bytes: int) -> dict[str, float]:
    """Bytes one rank sends per layer and micro-batch for context-parallel attention, by direction of the pass
    (see the module docstring): ``forward`` and ``backward``."""
    cp, tp, b = layout.cp, layout.tp, layout.micro_batch_size
    if cp == 1:
        return {"forward": 0.0, "backward": 0.0}
    s = model.seq_length // cp
    kv = 2 * b * s * max(model.query_groups // tp, 1) * model.head_dim   # this rank's K and V elements
    p = dtype_bytes
    if layout.cp_comm_type == "p2p":   # K/V blocks CP-1 times; backward also the fp32 dK/dV accumulators CP times
        return {"forward": (cp - 1) * kv * p, "backward": (cp - 1) * kv * p + cp * kv * 4}
    if layout.cp_comm_type == "a2a":   # q, [k; v] and the output, (CP-1)/CP of each leaving the rank
        moved = (cp - 1) / cp * b * s * (2 * model.hidden_size / tp) * p + (cp - 1) / cp * kv * p
        return {"forward": moved, "backward": moved}
    if layout.cp_comm_type == "a2a+p2p":   # a2a over its A ranks, then a ring of CP / A over 1/A of the heads
        return {direction: a2a + ring for direction, a2a, ring in zip(
            ("forward", "backward"), *(_hierarchical_bytes(model, layout, dtype_bytes)))}
    return {"forward": (cp - 1) * kv * p, "backward": (cp - 1) * kv * p}   # all-gather, its reduce-scatter


def _hierarchical_bytes(model: ModelConfig, layout: Layout, dtype_bytes: int) -> tuple[tuple[float, float], ...]:
    """a2a+p2p's bytes one rank sends per layer and micro-batch, (forward, backward) of each level: the a2a over its
    A ranks (as a2a's at CP = A, of the rank's s / CP tokens), then the ring over CP / A groups, whose K/V blocks hold
    A x the tokens for 1/A of the heads: as many elements as p2p's."""
    a, b, p, tp = layout.cp_a2a, layout.micro_batch_size, dtype_bytes, layout.tp
    ring = layout.cp // a
    s = model.seq_length // layout.cp
    kv = 2 * b * s * max(model.query_groups // tp, 1) * model.head_dim
    moved = (a - 1) / a * b * s * (2 * model.hidden_size / tp) * p + (a - 1) / a * kv * p
    return (moved, moved), ((ring - 1) * kv * p, (ring - 1) * kv * p + ring * kv * 4)


def context_parallel_layer_time(model: ModelConfig, layout: Layout, hardware: Hardware, core_time: float,
                                dtype_bytes: int) -> tuple[float, float]:
    """(total, exposed) seconds per layer and micro-batch of context-parallel attention's communication.
    ``core_time``: the attention core's forward and backward compute on this rank (a third forward). The ring
    overlaps each of its CP - 1 transfers with one block's compute (the last dK/dV transfer shows); a2a and
    allgather wait for their collectives."""
    if layout.cp == 1:
        return 0.0, 0.0
    cp, bw = layout.cp, hardware.bandwidth(layout.tp * layout.cp)
    inner = 0.0   # a2a+p2p: the a2a level's time, on its own (inside a node) links; the ring is then CP / A ranks
    if layout.cp_comm_type == "a2a+p2p":
        a2a_sent, ring_sent = _hierarchical_bytes(model, layout, dtype_bytes)
        recomputed = model.recompute_granularity in ("full", "selective")
        inner = (a2a_sent[0] * (2 if recomputed else 1) + a2a_sent[1]) / hardware.bandwidth(layout.tp * layout.cp_a2a)
        cp = layout.cp // layout.cp_a2a
        sent = {"forward": ring_sent[0] * (2 if recomputed else 1), "backward": ring_sent[1]}
        total = inner + (sent["forward"] + sent["backward"]) / bw
        kv_transfer = ring_sent[0] / (cp - 1) / bw if cp > 1 else 0.0
        return _ring_exposure(model, cp, core_time, sent, kv_transfer, bw, total, inner)
    sent = context_parallel_bytes(model, layout, dtype_bytes)
    if model.recompute_granularity in ("full", "selective"):   # the core's forward runs again in backward
        sent = {"forward": sent["forward"] * 2, "backward": sent["backward"]}
    total = (sent["forward"] + sent["backward"]) / bw
    if layout.cp_comm_type != "p2p":
        return total, total
    kv_transfer = context_parallel_bytes(model, layout, dtype_bytes)["forward"] / (cp - 1) / bw
    return _ring_exposure(model, cp, core_time, sent, kv_transfer, bw, total, 0.0)


def _ring_exposure(model: ModelConfig, cp: int, core_time: float, sent: dict[str, float], kv_transfer: float,
                   bw: float, total: float, exposed_before: float) -> tuple[float, float]:
    """(total, exposed) of a ring of ``cp`` ranks: each of its CP - 1 K/V transfers overlaps one block's compute,
    the last dK/dV transfer shows."""
    forward_block, backward_block = core_time / 3 / cp, core_time * 2 / 3 / cp
    steps = cp - 1
    grad_transfer = (sent["backward"] / bw - steps * kv_transfer) / cp
    passes = 2 if model.recompute_granularity in ("full", "selective") else 1
    exposed = (passes * steps * max(0.0, kv_transfer - forward_block)
               + steps * max(0.0, kv_transfer + grad_transfer - backward_block) + grad_transfer)
    return total, exposed_before + exposed


def all_to_all_bytes(model: ModelConfig, layout: Layout, num_micro_batches: int, dtype_bytes: int = 2) -> float:
    """Bytes one GPU sends over the expert-parallel group per step, over all MoE layers of the model (each stage
    sends those of its layers): per MoE layer and micro-batch of T = s b tokens, the alltoall dispatcher's two
    all-to-alls forward and two backward carry k T hidden-sized rows each, (EP - 1) / EP of them to other ranks
    (balanced routing); the allgather dispatcher's all-gather and reduce-scatter forward (and their conjugates
    backward) move (EP - 1) T rows each (a ring: whatever k)."""
    ep = layout.ep
    if ep == 1 or model.num_experts is None:
        return 0.0
    rows = model.seq_length // layout.cp * layout.micro_batch_size   # a context-parallel rank routes s / CP tokens
    per_layer = (4 * model.moe_router_topk * rows * (ep - 1) / ep if model.moe_token_dispatcher_type == "alltoall"
                 else 4 * (ep - 1) * rows)
    return per_layer * model.hidden_size * dtype_bytes * sum(model.moe_layers()) * num_micro_batches


def _data_parallel_time(model: ModelConfig, layout: Layout, hardware: Hardware, num_micro_batches: int,
                        compute_per_micro_batch: float, dtype_bytes: int) -> tuple[float, float]:
    """(total, exposed) seconds of the data-parallel gradient reduction and parameter gather per step: the dense
    engine's over DP x CP (the ranks holding one model shard), and with a mixture of experts the experts' engine
    over the expert-data-parallel ranks."""
    tp, dp = layout.tp, layout.shard_replicas
    states = model_state_bytes(model, layout, 0, dtype_bytes=dtype_bytes)
    fp8 = fp8_gathered_elements(model, layout)
    elements = (states.weights - fp8) / dtype_bytes          # the padded flat buffers (less the FP8 copies' byte)
    expert_elements = sum(t.numel for chunk in rank_tensors(model, tp, layout.pp, layout.virtual_stages, 0,
                                                            layout.placement, ep=layout.ep,
                                                            expert_tp=layout.expert_tp, split=layout.split)
                          for t in chunk if t.expert)
    embedding_sum = 0.0
    if layout.pp > 1 and not model.untie_embeddings_and_output_weights:
        tied = model.padded_vocab_size(tp) * model.hidden_size // tp * 4
        embedding_sum = ring_all_reduce_time(tied, 2, hardware.bandwidth(hardware.num_gpus))
    times = [_engine_time(elements - expert_elements, dp, layout, hardware, num_micro_batches,
                          compute_per_micro_batch, dtype_bytes, fp8, layout.instances),
             _engine_time(expert_elements, layout.expert_dp, layout, hardware, num_micro_batches,
                          compute_per_micro_batch, dtype_bytes)]
    return sum(t for t, _ in times) + embedding_sum, sum(e for _, e in times) + embedding_sum


def fp8_gathered_elements(model: ModelConfig, layout: Layout) -> int:
    """Elements of the dense engine's buckets that --fp8-param-gather gathers in FP8 (0 without it): those of the
    FP8 linears' weights, padding included, on pipeline rank 0."""
    if not model.fp8_param_gather or layout.zero not in (1, 2) or layout.replicas == 1:
        return 0
    tensors = [t for chunk in rank_tensors(model, layout.tp, layout.pp, layout.virtual_stages, 0, layout.placement,
                                           ep=layout.ep, expert_tp=layout.expert_tp, split=layout.split)
               for t in chunk if not t.expert]
    plan, fp8 = engine_buckets(tensors, layout.replicas, layout.zero, default_bucket_size(layout.replicas))
    return sum(plan.buckets[i].end - plan.buckets[i].start for i in fp8)


def _across_instances_time(shard_bytes: float, layout: Layout, hardware: Hardware) -> float:
    """HSDP's second level: the all-reduce of a reduced shard of ``shard_bytes`` over the instances, one rank of each,
    DP x CP / instances x TP ranks apart (across nodes once the instances do not share one: the slowest link)."""
    return ring_all_reduce_time(shard_bytes, layout.instances, hardware.bandwidth(layout.tp * layout.replicas))


def _engine_time(elements: float, dp: int, layout: Layout, hardware: Hardware, num_micro_batches: int,
                 compute_per_micro_batch: float, dtype_bytes: int, fp8_elements: float = 0,
                 instances: int = 1) -> tuple[float, float]:
    """(total, exposed) seconds of one engine's reduction (and gather) of ``elements`` over ``dp`` ranks, of which
    ``fp8_elements`` are gathered in one byte (--fp8-param-gather). With HSDP ``instances`` > 1 the reduced shards
    are all-reduced across the instances: once per bucket after its reduce-scatter at ZeRO-1 (overlapped alike), once
    per step after the backward at ZeRO-2 (exposed)."""
    if dp * instances == 1 or elements == 0:
        return 0.0, 0.0
    grad_bytes = elements * 4
    bw = hardware.bandwidth(layout.tp * dp)
    bucket_bytes = min(default_bucket_size(dp), elements) * 4
    backward = compute_per_micro_batch * 2 / 3                # the last micro-batch's backward
    forward = compute_per_micro_batch / 3                     # the next step's first forward
    if layout.zero == 0:
        reduce = ring_all_reduce_time(grad_bytes, dp, bw)
        last = ring_all_reduce_time(bucket_bytes, dp, bw)
        return reduce, max(last, reduce - backward)
    gather = ring_gather_time((elements - fp8_elements) * dtype_bytes + fp8_elements, dp, bw)
    gather_exposed = max(ring_gather_time(bucket_bytes / 4 * dtype_bytes, dp, bw), gather - forward)
    scatter = ring_gather_time(grad_bytes, dp, bw)
    last = ring_gather_time(bucket_bytes, dp, bw)
    across = _across_instances_time(grad_bytes / dp, layout, hardware) if instances > 1 else 0.0
    if layout.zero == 1:
        last += _across_instances_time(bucket_bytes / dp, layout, hardware) if instances > 1 else 0.0
        return scatter + across + gather, max(last, scatter + across - backward) + gather_exposed
    scatters = num_micro_batches * scatter                    # ZeRO-2: every micro-batch
    exposed = max(last, scatters - backward * num_micro_batches)
    return scatters + across + gather, exposed + across + gather_exposed


def _fully_sharded_time(model: ModelConfig, layout: Layout, hardware: Hardware, num_micro_batches: int,
                        layer_forward: float, layer_backward: float, dtype_bytes: int) -> tuple[float, float]:
    """(total, exposed) seconds of ZeRO-3's gathers and reduce-scatters per step (see the module docstring); with HSDP
    each reduce-scatter of a dense unit is followed by the all-reduce of its shard across the instances."""
    dp = layout.shard_replicas
    if dp == 1:
        return 0.0, 0.0
    bw = hardware.bandwidth(layout.tp * dp)
    units = fully_sharded_units(model, layout.tp, layout.pp, layout.virtual_stages, 0, layout.ep, layout.expert_tp,
                                layout.split)
    root = sum(padded_elements(unit, dp) for unit in units.roots)
    expert_dp = layout.expert_dp
    # The largest layer, with its routed experts' unit (gathered over the expert-data-parallel ranks).
    index, (layer, experts) = max(enumerate((padded_elements(unit, dp), padded_elements(routed, expert_dp))
                                            for unit, routed in zip(units.layers, units.experts)),
                                  key=lambda found: sum(found[1]), default=(0, (0, 0)))
    # --fp8-param-gather: the FP8 linears' weights travel in one byte an element.
    fp8 = (sum(padded_elements([t], dp) for t in units.layers[index] if t.fp8)
           if model.fp8_param_gather and units.layers else 0)

    def gather(elements: float, n: int = dp) -> float:
        return ring_gather_time(elements * dtype_bytes, n, bw)

    def scatter(elements: float, n: int = dp) -> float:
        across = _across_instances_time(elements * 4 / n, layout, hardware) if n == dp and layout.instances > 1 else 0
        return ring_gather_time(elements * 4, n, bw) + across

    layer_gather = ring_gather_time((layer - fp8) * dtype_bytes + fp8, dp, bw) + gather(experts, expert_dp)
    layer_scatter = scatter(layer) + scatter(experts, expert_dp)
    n = len(units.layers)
    total = gather(root) + scatter(root) + n * (2 * layer_gather + layer_scatter)
    # Shown at the ends: the root's and the first layer's gathers, which start the forward; the first layer's and the
    # root's reduce-scatters, which end the backward. In between, layer i's forward hides layer i+1's gather, and
    # its backward layer i-1's gather and layer i+1's reduce-scatter: n - 1 of each (the last layer's gather for
    # backward hides behind the output layer's backward).
    ends = gather(root) + layer_gather + layer_scatter + scatter(root)
    between = max(0, n - 1) * (max(0.0, layer_gather - layer_forward)
                               + max(0.0, layer_gather + layer_scatter - layer_backward))
    return num_micro_batches * total, num_micro_batches * (ends + between)


def newton_schulz_flops(gram: int, other: int, steps: int) -> float:
    """FLOPs of ``steps`` quintic Newton-Schulz steps on a matrix whose Gram side (X X^T's) has ``gram`` rows and
    the other side ``other`` (megalite.optimizer.muon.newton_schulz): per step X X^T, the polynomial's A^2 and its
    product with X."""
    return steps * 2.0 * (2 * gram * gram * other + gram ** 3)


@dataclass(frozen=True)
class MuonCost:
    """Muon's work per step on the busiest rank of the slowest pipeline stage (see the module docstring)."""
    flops: float = 0.0      # Newton-Schulz FLOPs
    tp_bytes: float = 0.0   # fp32 bytes of the TP collectives (duplicated: gathered matrices; distributed: Gram sums)
    dp_bytes: float = 0.0   # fp32 bytes of the layer-wise distribution (the buckets gathered and scattered; ZeRO-3:
                            # what the rank sends in the two all-to-alls)
    seconds: float = 0.0    # all of it, not hidden


def _matrix_cost(t: Tensor, layout: Layout, model: ModelConfig, hardware: Hardware,
                 world: int) -> tuple[float, float, float]:
    """(FLOPs, TP bytes, TP seconds) of orthogonalizing one matrix this rank holds (its TP slice ``t``)."""
    steps, mode = layout.muon_ns_steps, layout.muon_tp_mode
    rows, cols = t.rows, t.numel // t.rows
    split = t.tp_dim if world > 1 else None
    blocks = [rows]
    if layout.muon_split_qkv and t.name.endswith("linear_qkv.weight"):   # q, k and v, each on its own
        groups = model.query_groups * model.head_dim
        blocks = [size // world for size in (model.query_size, groups, groups)]
    flops = tp_bytes = seconds = 0.0
    bw = hardware.bandwidth(world)
    for local_rows in blocks:
        if split is None or mode == "blockwise":
            flops += newton_schulz_flops(min(local_rows, cols), max(local_rows, cols), steps)
        elif mode == "duplicated":
            full_rows, full_cols = (local_rows * world, cols) if split == 0 else (local_rows, cols * world)
            flops += newton_schulz_flops(min(full_rows, full_cols), max(full_rows, full_cols), steps)
            tp_bytes += full_rows * full_cols * 4
            seconds += ring_gather_time(full_rows * full_cols * 4, world, bw)
        else:   # distributed: the unsplit side's Gram matrix, whole on every rank, summed over TP each step
            gram, long = (cols, local_rows) if split == 0 else (local_rows, cols)
            flops += newton_schulz_flops(gram, long, steps)
            tp_bytes += steps * gram * gram * 4 + 4
            seconds += steps * ring_all_reduce_time(gram * gram * 4, world, bw) + ring_all_reduce_time(4, world, bw)
    return flops, tp_bytes, seconds


def _owned_cost(matrices: list[Tensor], dp: int, layered: bool, layout: Layout, model: ModelConfig,
                hardware: Hardware, world: int) -> tuple[float, float, float, int]:
    """(FLOPs, TP bytes, seconds, rank) of the busiest of ``dp`` ranks when each matrix is owned by one (``layered``),
    else of any rank (each orthogonalizes all of them)."""
    rate = hardware.peak_flops * TF32_PEAK_RATIO * hardware.efficiency
    costs = [_matrix_cost(t, layout, model, hardware, world) for t in matrices]
    owner = owners([t.numel for t in matrices], dp) if layered else [0] * len(matrices)
    per_rank = [[0.0, 0.0, 0.0] for _ in range(dp if layered else 1)]
    for (flops, tp_bytes, seconds), rank in zip(costs, owner):
        per_rank[rank][0] += flops
        per_rank[rank][1] += tp_bytes
        per_rank[rank][2] += flops / rate + seconds
    rank = max(range(len(per_rank)), key=lambda r: per_rank[r][2])
    return (*per_rank[rank], rank)


def _distribution_bytes(matrices: list[Tensor], tensors: list[Tensor], dp: int, layout: Layout) -> float:
    """fp32 bytes of one engine's layer-wise distribution per step: the buckets holding matrices, whole (ZeRO-1/2:
    each all-gathered, then reduce-scattered); ZeRO-3: the most any rank sends or receives in one all-to-all (its
    rows of the others' matrices; the other ranks' rows of its own), twice."""
    if layout.zero in (1, 2):
        plan, _ = engine_buckets(tensors, dp, layout.zero, default_bucket_size(dp))
        held = {id(t) for t in matrices}
        return 2 * 4.0 * sum(b.end - b.start for b in plan.buckets if any(id(p.tensor) in held for p in b.params))
    owner = owners([t.numel for t in matrices], dp)
    most = 0
    for rank in range(dp):
        mine = [shard_rows(t.rows, dp, rank) * (t.numel // t.rows) for t in matrices]
        sent = sum(n for n, o in zip(mine, owner) if o != rank)
        received = sum(t.numel - n for t, n, o in zip(matrices, mine, owner) if o == rank)
        most = max(most, sent, received)
    return 2 * 4.0 * most


def muon_step_cost(model: ModelConfig, layout: Layout, hardware: Hardware) -> MuonCost:
    """Muon's Newton-Schulz FLOPs, communication and seconds per step (see the module docstring): the slowest
    pipeline stage's, on its busiest data-parallel rank (the dense matrices' and the routed experts' owners)."""
    worst = MuonCost()
    layered = layout.zero in (1, 2, 3)
    for pp_rank in range(layout.pp):
        tensors = [t for chunk in rank_tensors(model, layout.tp, layout.pp, layout.virtual_stages, pp_rank,
                                               layout.placement, ep=layout.ep, expert_tp=layout.expert_tp,
                                               split=layout.split) for t in chunk]
        flops = tp_bytes = dp_bytes = seconds = 0.0
        for expert, dp, world in ((False, layout.replicas, layout.tp), (True, layout.expert_dp, layout.expert_tp)):
            engine = [t for t in tensors if t.expert == expert]
            matrices = [t for t in engine if is_muon_matrix(t)]
            if not matrices:
                continue
            spread = layered and dp > 1
            f, b, s, _ = _owned_cost(matrices, dp, spread, layout, model, hardware, world)
            moved = _distribution_bytes(matrices, engine, dp, layout) if spread else 0.0
            flops, tp_bytes, dp_bytes = flops + f, tp_bytes + b, dp_bytes + moved
            ring = (dp - 1) / dp if layout.zero in (1, 2) else 1.0   # ZeRO-3's all-to-all bytes are those sent
            seconds += s + moved * ring / hardware.bandwidth(layout.tp * dp)
        if seconds > worst.seconds:
            worst = MuonCost(flops, tp_bytes, dp_bytes, seconds)
    return worst
