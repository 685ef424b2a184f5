"""Per-GPU memory of a layout: model states (weights, gradients, optimizer states) and activations.

Model states, as megalite holds them (tests: within 1% of the tensors a real DataParallel + MegaliteOptimizer
allocate; in fact exact, bucket padding included):

- weights: this rank's parameters, in the model dtype, living in one flat buffer per rank, padded per bucket to a
  multiple of DP x 16 elements (megalite.distributed.buckets) - the padding is real memory; under the distributed
  optimizer the FP8 linears' weights have buckets of their own, and with ``--fp8-param-gather`` one byte more per
  element of those buckets (the FP8 copies they are gathered into);
- gradients: fp32 (``main_grad`` buckets) whatever the model dtype (bf16 with ``--grad-reduce-in-bf16``, the
  ``grad_bytes`` argument): the whole padded buffer, or with ZeRO-2
  only this rank's 1/DP shard of each bucket (plus, transiently, the bf16 ``param.grad`` of a bucket not yet
  reduced: not counted);
- optimizer: Adam's exp_avg and exp_avg_sq in fp32 (8 bytes), plus a separate fp32 main copy (4 bytes) when the
  model is bf16/fp16 (an fp32 model steps its own storage: no copy), for this rank's parameters, or with the
  distributed optimizer for the real (not padding) elements of this rank's shard of each bucket;
  ``--optimizer-cpu-offload`` moves all of it to the host. With ``--optimizer muon`` the hidden matrices (2-D, not
  the embeddings or the output layer) keep Muon's one momentum buffer (4 bytes) instead of Adam's two; Muon's
  transient work (the gathered matrix, Newton-Schulz's Gram products) is not counted.

With HSDP (``--num-distributed-optimizer-instances N``) every "1/DP" here and at ZeRO-3 below is 1/(DP x CP / N):
ZeRO shards over one instance of DP x CP / N ranks, and the N instances hold the same shards.

ZeRO-3 (``--zero-stage 3``, FSDP2, megalite.distributed.fully_sharded) holds no flat buffer: every tensor (this TP
rank's slice) is cut by rows over DP, ceil(rows / DP) rows per rank, so DP rank 0 holds the most (tests: equal to the
byte to what the real engine allocates on every rank, tests/multiprocess/test_planner_zero3.py). The shards stay
fp32 whatever the model dtype and are the optimizer's main parameters: weights 4 bytes, gradients 4 (fp32), Adam 8
(Muon 4 for the hidden matrices' rows) per element of the shard, and no main copy. ``--optimizer-cpu-offload`` moves Adam and a main copy (12) to the host;
with ``--offload-params`` too, the weight and gradient shards go there as well (the main copy is then the shard
itself: 4 + 4 + 8 on the host, nothing on the device).

What ZeRO-3 adds on the device instead is working memory, ``gathered``: the parameters FSDP2 all-gathers for compute,
in the compute dtype (p bytes), and the unsharded gradients before they are reduce-scattered. Read off FSDP2's
schedule (torch.distributed.fsdp._fully_shard), at its peak, during the transformer layers' backward, which is also
when the activations peak (the start of the backward), and counted on top of them (tests: gathered + activations
within 1% of the peak bytes a CPU training step allocates, tests/multiprocess/test_planner_zero3.py):

- the root unit (embeddings, final norm, output layer): p bytes per element, the whole step: FSDP2 does not reshard
  the root after forward, as backward needs it at once;
- the root's gradients that backward produces first, the output layer's (the word embedding's, tied) and the final
  norm's, p bytes each: the root reduce-scatters only once the whole backward is done (its inputs, token ids, need
  no gradient, so its post-backward runs in FSDP2's final callback);
- the largest layer three times in p bytes, the running one, the one prefetched for the next backward (FSDP2
  prefetches one unit ahead), and the running one's unsharded gradient; plus once in fp32 the previous layer's
  reduce-scatter input, which FSDP2 keeps until the next reduction so that the communication overlaps: 3p + 4
  bytes per element of a layer (gathered units are padded to DP x ceil(rows / DP) rows; with --fp8-param-gather
  the FP8 linears' weights are gathered in one byte, 2 + p + 4). With
  ``--zero3-prefetch-bucket-size`` each layer prefetches the k layers that fit, (k + 2) p + 4 bytes.

Not counted, being smaller than that peak when they happen: at the very end of the backward, when the activations
are gone, the root's gradients copied into an fp32 reduce-scatter input, R (2p + 4) bytes for a root of R elements;
in forward, at most two layers gathered beyond the root (the running one and, on CUDA, the next one, which FSDP2
gathers ahead on its own stream); shard-sized casts and host-device copies (1/DP of a unit).

Bytes per parameter that follow (``bytes_per_parameter``), next to the published numbers they differ from:

| | unsharded | distributed optimizer (ZeRO-1) | ZeRO-2 | ZeRO-3 |
|---|---|---|---|---|
| megalite bf16/fp16 | 18 | 6 + 12/DP | 2 + 16/DP | 16/DP |
| megalite fp32 | 16 | 8 + 8/DP | 4 + 12/DP | 16/DP |
| Megatron docs, bf16 params + fp32 grads | 18 | 6 + 12/d | - | - |
| Megatron docs, fp16 params + fp16 grads | 20 | 4 + 16/d | - | - |
| ZeRO paper (Rajbhandari et al. 2020, fp16 grads, K=12) | 16 | 4 + 12/N | 2 + 14/N | 16/N |

megalite's gradients are fp32 (4 bytes, where ZeRO's are fp16), hence 2 more bytes per parameter than the paper at
stages 0-2. At stage 3 the totals agree, split differently: the paper's 2 (fp16 weights) + 2 (fp16 gradients) + 12
(fp32 main copy and Adam) against megalite's 4 (fp32 weights, the main copy) + 4 (fp32 gradients) + 8 (Adam), all
over N; ZeRO-3's ``gathered`` working memory comes on top, and does not shrink with DP.

Activations, per transformer layer and micro-batch (s sequence, b micro-batch, h hidden, a heads, t TP; p bytes per
activation element, m per dropout-mask element): Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Table 2: sbh(34 + 5as/h) bytes for p = 2, m = 1; sbh(10 + 24/t + 5as/(ht)) with TP;
sbh/t (34 + 5as/h) with sequence parallelism; 34 sbh/t adding selective recompute; 2sbh with full recompute. Written
out for this implementation (what autograd keeps, read off saved-tensor hooks; tests: within 15% of the measured
bytes on the CPU, exactly equal in fact):

    replicated over TP (split by t under sequence parallelism):
        4p sbh   the two norm inputs, the QKV and fc1 inputs          (paper: 8 sbh)
        2m sbh   the two residual dropout masks, if hidden dropout > 0  (paper: 2 sbh)
        per-token norm statistics in fp32 (LayerNorm: mean and 1/std; RMSNorm: 1/std; the paper leaves them out)
    split over TP:
        p sbh (h + 2 G d)/h / t    the fused QKV output (q, k, v are views of it; G = h/d without grouping: 3p);
                                   with G < t each rank gathers its key/value head into a copy (2 d per token),
                                   which replaces the fused output when rotary embeddings make q a copy too
        p sbh (h + G d)/h / t      rotary embeddings: the rotated q and k are new tensors (plus cos and sin)
        p sbh / t                  the output projection's input (the attention output: same storage)
        p sbh f/h x 2 / t          GeLU: its input and output (f = 4h: the paper's 16 sbh / t)
        p sbh f/h x 4 / t          SwiGLU: the fc1 output [gate; up], silu(gate), and the product
    the attention core (what selective recompute does not keep):
        fused kernel (flash attention):   the log-sum-exp, 4 bytes x b a s / t; nothing s^2-sized
        math path (CPU with dropout):     the paper's as^2 b (2p + m) / t: softmax, dropout mask, dropout output
        unfused core (--use-fused-kernels on, the masked softmax): the same, as^2 b p / t without dropout
        attention sinks (--softmax-type; megalite.model.sinks): the fp32 softmax, 4 as(s + 1) b / t, plus the
                                          probabilities in p bytes where p != 4, dropout's as^2 b (m + p) / t, the
                                          s^2 boolean mask, and repeated keys and values under grouped queries
                                          (exact without grouping; with it the matmuls' copies of q, k and v
                                          replace the fused QKV output, which this leaves counted: ~10% over at
                                          s = 32, less as the s^2 terms grow)
    full recompute: p sbh (/ t under sequence parallelism), the layer's input only.
    context parallelism (CP): every term above for the rank's s / CP tokens (the math path's scores: its queries
        against all s keys), plus what the comm type keeps (context_parallel_core_bytes): nothing for p2p, a2a's
        output in the head-sharded layout, allgather's keys and values of the whole sequence.
    FP8 linears (tensorwise, delayed; ``fp8_saved_difference``): the QKV, fc1 and fc2 inputs in 1 byte, not p; the
        output projection's input 1 byte more (the core keeps its output), or 1 not p under selective recompute;
        an FP8 copy of each weight slice, 1 byte an element (none with --fp8-param-gather); equal to the byte.

On the GPU the planner assumes bf16 (p = 2), CUDA dropout's byte masks (m = 1) and torch's flash attention, which
regenerates its dropout mask in backward, so there is no 5as/h term at all (the paper's formula is for unfused
attention); ``Numerics.cpu`` describes the CPU (p = 4, float dropout noise m = 4, the math path when attention
dropout is on), which is what the tests measure.

Per micro-batch and stage, besides the layers: the first stage keeps the token ids and the embedding dropout mask;
a stage's output is freed once sent (the engine keeps only its graph); the last stage keeps the final norm's and output layer's inputs and the fp32 softmax of vocab-parallel cross
entropy, 4 x b s V / t bytes, plus transiently the logits and two fp32 working copies of them. Multi-token
prediction adds on the last stage, per depth, a layer like the last one (under full recompute its input only, the
layer rerun alone), the shifted tokens' embedding as on the first stage, the embedding norm's input and the 2h
concatenation (the hidden norm's input is the previous output layer's), and the output layer's and loss's share again.

Micro-batches in flight: counted by running megalite's own schedules (megalite.pipeline.schedules). The first stage
of 1F1B holds PP micro-batches of its L/PP layers, L layers' worth; interleaved 1F1B holds L (1 + (PP - 1)/(PP V))
layers' worth, Megatron's factor (Korthikanti et al. 2022, for Narayanan et al. 2021's schedule). The zero-bubble
schedules hold a micro-batch from its F to its W; after its B only what the W needs (``weight_gradient_bytes``:
the linear layers' inputs and output gradients). ZB-H1's first stage holds what 1F1B's does (PP micro-batches, each
W right after its B), later stages more than in 1F1B but not more than the first (Qi et al. 2023). The most loaded
stage is the one with the largest total.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

from megalite.config import ModelConfig
from megalite.distributed.buckets import BucketPlan, plan_buckets
from megalite.distributed.data_parallel import default_bucket_size
from megalite.pipeline.partition import chunks_of_rank
from megalite.pipeline.schedules import build_schedule
from megalite.planner.layout import Layout
from megalite.planner.parameters import Tensor, rank_tensors


def bytes_per_parameter(zero: int, dp: int, dtype_bytes: int = 2) -> float:
    """Model-state bytes per parameter in megalite (see the table above): weights + fp32 gradients + fp32 Adam
    states (+ fp32 main copy unless the model is fp32), with ``zero`` 0 (unsharded), 1, 2 or 3 sharding over ``dp``
    (3: fp32 weight, gradient and Adam shards whatever the model dtype; the gathered working memory not included)."""
    if zero == 3:
        return 16 / dp
    main = 0 if dtype_bytes == 4 else 4
    optimizer = main + 8
    if zero == 0:
        return dtype_bytes + 4 + optimizer
    if zero == 1:
        return dtype_bytes + 4 + optimizer / dp
    return dtype_bytes + (4 + optimizer) / dp


# ---- model states ---------------------------------------------------------------------------------------------------

class _Sized:
    """A stand-in for a parameter in megalite.distributed.buckets.plan_buckets, which needs only numel()."""
    __slots__ = ("n", "tensor")

    def __init__(self, n: int, tensor: Optional[Tensor] = None):
        self.n, self.tensor = n, tensor

    def numel(self) -> int:
        return self.n


@dataclass(frozen=True)
class ModelStates:
    weights: float           # bytes on the device
    gradients: float
    optimizer: float
    host_optimizer: float = 0.0   # bytes on the host (CPU offload)
    host_weights: float = 0.0     # ZeRO-3 --offload-params: the parameter shards on the host
    host_gradients: float = 0.0   # ... and the gradient shards
    gathered: float = 0.0         # ZeRO-3 working memory on the device: gathered units, unsharded gradients

    @property
    def total(self) -> float:
        """On the device, the gathered working memory left out."""
        return self.weights + self.gradients + self.optimizer

    @property
    def host(self) -> float:
        return self.host_weights + self.host_gradients + self.host_optimizer


def model_state_bytes(model: ModelConfig, layout: Layout, pp_rank: int = 0, *, dtype_bytes: int = 2,
                      dp_rank: int = 0, bucket_size: Optional[int] = None,
                      prefetch_bucket_size: Optional[int] = None, grad_bytes: int = 4) -> ModelStates:
    """Exact model-state bytes of one rank, from megalite's own bucket layout (DP rank 0 holds the most: bucket
    padding sits at the end of each bucket, in the last rank's shard), or at ZeRO-3 from FSDP2's row shards (DP rank
    0 holds the most: ceil(rows / DP) rows, the last ranks fewer). ``bucket_size``: --ddp-bucket-size at stages 0-2;
    ``prefetch_bucket_size``: --zero3-prefetch-bucket-size at stage 3."""
    replicas = layout.shard_replicas   # DP x CP (with HSDP, one instance of it): the ranks ZeRO shards over
    experts = (layout.ep, layout.expert_tp)
    if layout.zero == 3:
        key = (dataclasses.astuple(model), layout.tp, layout.pp, layout.virtual_stages, replicas,
               layout.optimizer_cpu_offload, layout.offload_params, pp_rank, dtype_bytes, dp_rank,
               prefetch_bucket_size, experts, layout.split, layout.muon)   # 1f1b only
        if key not in _STATES_CACHE:
            _STATES_CACHE[key] = _fully_sharded_state_bytes(model, *key[1:])
        return _STATES_CACHE[key]
    key = (dataclasses.astuple(model), layout.tp, layout.pp, layout.virtual_stages, replicas, layout.zero,
           layout.optimizer_cpu_offload, pp_rank, dtype_bytes, dp_rank, bucket_size, grad_bytes, layout.placement,
           experts, layout.split, layout.muon)
    if key not in _STATES_CACHE:   # the search asks again for every micro-batch size and recompute option
        _STATES_CACHE[key] = _model_state_bytes(model, *key[1:])
    return _STATES_CACHE[key]


_STATES_CACHE: dict[tuple, ModelStates] = {}


def _model_state_bytes(model: ModelConfig, tp: int, pp: int, v: int, dp: int, zero: int, offload: bool, pp_rank: int,
                       dtype_bytes: int, dp_rank: int, bucket_size: Optional[int], grad_bytes: int,
                       placement: str, experts: tuple[int, int], split: Optional[tuple[int, ...]],
                       muon: bool = False) -> ModelStates:
    """The engines' flat buffers: one over DP, and with a mixture of experts one for the routed experts over the
    expert-data-parallel ranks (megalite.distributed.expert_parallel), each planned as the engine plans it."""
    ep, expert_tp = experts
    tensors = [t for chunk in rank_tensors(model, tp, pp, v, pp_rank, placement, ep=ep, expert_tp=expert_tp,
                                           split=split) for t in chunk]
    dense = _engine_state_bytes([t for t in tensors if not t.expert], dp, zero, dtype_bytes, dp_rank,
                                bucket_size or default_bucket_size(dp), grad_bytes, model.fp8_param_gather, muon)
    routed = [t for t in tensors if t.expert]
    if not routed:
        weights, gradients, owned, matrices = dense
    else:   # (expert-data-parallel rank: the ranks of one expert-parallel group come first)
        expert_dp = dp // ep
        expert = _engine_state_bytes(routed, expert_dp, zero, dtype_bytes, dp_rank // ep,
                                     bucket_size or default_bucket_size(expert_dp), grad_bytes, muon=muon)
        weights, gradients, owned, matrices = (a + b for a, b in zip(dense, expert))
    main_copy = 0 if dtype_bytes == 4 and not offload else 4
    optimizer = owned * (8 + main_copy) - matrices * 4   # Muon's one buffer where Adam keeps two
    if offload:
        return ModelStates(weights, gradients, 0.0, optimizer)
    return ModelStates(weights, gradients, optimizer)


def expert_state_bytes(model: ModelConfig, layout: Layout, pp_rank: int = 0, *, dtype_bytes: int = 2,
                       bucket_size: Optional[int] = None) -> float:
    """Of :func:`model_state_bytes`' device bytes (weights, gradients, optimizer states; DP rank 0), the routed
    experts' (their own engine over the expert-data-parallel ranks; ZeRO-3: their shards over those ranks)."""
    tensors = [t for chunk in rank_tensors(model, layout.tp, layout.pp, layout.virtual_stages, pp_rank,
                                           layout.placement, ep=layout.ep, expert_tp=layout.expert_tp,
                                           split=layout.split) for t in chunk if t.expert]
    if not tensors or layout.optimizer_cpu_offload:
        return 0.0 if not tensors else sum(t.numel for t in tensors) * (dtype_bytes + 4)
    if layout.zero == 3:
        return 16.0 * sum(shard_rows(t.dim0, layout.expert_dp, 0) * (t.numel // t.dim0) for t in tensors)
    weights, gradients, owned, matrices = _engine_state_bytes(tensors, layout.expert_dp, layout.zero, dtype_bytes, 0,
                                                              bucket_size or default_bucket_size(layout.expert_dp),
                                                              muon=layout.muon)
    return weights + gradients + owned * (8 + (0 if dtype_bytes == 4 else 4)) - matrices * 4


def engine_buckets(tensors: list[Tensor], dp: int, zero: int, bucket_size: int) -> tuple[BucketPlan, set[int]]:
    """One engine's bucket plan, as megalite.distributed.data_parallel makes it, and the indices of its buckets of
    FP8 linears' weights (their own buckets under the distributed optimizer)."""
    params = [_Sized(t.numel, t) for t in tensors]
    fp8 = [p for p, t in zip(params, tensors) if t.fp8] if zero in (1, 2) and dp > 1 else []
    plan = plan_buckets(params, bucket_size, dp, [p for p, t in zip(params, tensors) if t.deferred], fp8)
    return plan, {plan.bucket_of[id(p)] for p in fp8}


def _engine_state_bytes(tensors: list[Tensor], dp: int, zero: int, dtype_bytes: int, dp_rank: int,
                        bucket_size: int, grad_bytes: int = 4,
                        fp8_param_gather: bool = False, muon: bool = False) -> tuple[float, float, int, int]:
    """(weight bytes, gradient bytes, elements whose optimizer state this rank owns, of which Muon's matrices' with
    ``muon``) of one engine's buffers."""
    plan, fp8_buckets = engine_buckets(tensors, dp, zero, bucket_size)
    weights = plan.total * dtype_bytes
    if fp8_param_gather:
        weights += sum(plan.buckets[i].end - plan.buckets[i].start for i in fp8_buckets)
    if zero == 2:
        gradients = sum((b.end - b.start) // dp for b in plan.buckets) * grad_bytes
    else:
        gradients = plan.total * grad_bytes
    owned = matrices = 0
    for bucket in plan.buckets:
        first, last = bucket.shard(dp_rank, dp) if zero else (bucket.start, bucket.end)
        for p in bucket.params:   # the real elements of this rank's shard of each bucket (without ZeRO: all)
            start, end = plan.ranges[id(p)]
            elements = max(0, min(end, last) - max(start, first))
            owned += elements
            matrices += elements if muon and is_muon_matrix(p.tensor) else 0
    return weights, gradients, owned, matrices


def is_muon_matrix(tensor: Tensor) -> bool:
    """What --optimizer muon steps with Muon (megalite.optimizer.muon.is_muon_matrix): matrices but the embeddings
    and the output layer."""
    return tensor.rows > 0 and not tensor.name.startswith(("embedding.", "output_layer."))


def shard_rows(rows: int, dp: int, dp_rank: int) -> int:
    """Rows of a tensor on DP rank ``dp_rank`` under FSDP2's Shard(0): ceil(rows / DP) each, the last ranks fewer or
    none (as megalite.distributed.fully_sharded.row_range)."""
    per_rank = -(-rows // dp)
    return max(0, min(rows - dp_rank * per_rank, per_rank))


@dataclass(frozen=True)
class Units:
    """The FSDP2 units of a rank, as megalite.distributed.fully_sharded cuts them: each transformer layer, and for
    each model chunk one unit of the tensors left (embeddings, final norm, output layer): the root."""
    layers: list[list[Tensor]]
    roots: list[list[Tensor]]
    experts: list[list[Tensor]] = dataclasses.field(default_factory=list)   # per layer: its routed experts' unit
                                                                             # (empty for a dense layer)

    @property
    def tensors(self) -> list[Tensor]:
        return [t for unit in self.layers + self.roots + self.experts for t in unit]


def fully_sharded_units(model: ModelConfig, tp: int, pp: int = 1, v: int = 1, pp_rank: int = 0, ep: int = 1,
                        expert_tp: Optional[int] = None, split: Optional[tuple[int, ...]] = None) -> Units:
    """The units of pipeline rank ``pp_rank`` (with PP = 1 the whole model, one root; with pipelining one root per
    model chunk); an MoE layer's routed experts are a unit of their own, sharded over the expert-data-parallel
    ranks."""
    layers: dict[str, list[Tensor]] = {}
    experts: dict[str, list[Tensor]] = {}
    roots = []
    for chunk in rank_tensors(model, tp, pp, v, pp_rank, ep=ep, expert_tp=expert_tp, split=split):
        roots.append([t for t in chunk if not t.name.startswith("layers.")])
        for t in chunk:
            if t.name.startswith("layers."):
                layer = ".".join(t.name.split(".")[:2])
                layers.setdefault(layer, [])
                (experts.setdefault(layer, []) if t.expert else layers[layer]).append(t)
    return Units(list(layers.values()), roots, [experts.get(layer, []) for layer in layers])


def padded_elements(tensors: list[Tensor], dp: int) -> int:
    """Elements of the all-gathered copy of a unit: FSDP2 pads each tensor's rows to DP x ceil(rows / DP)."""
    return sum(-(-t.dim0 // dp) * dp * (t.numel // t.dim0) for t in tensors)


def prefetched_layers(units: Units, prefetch_bucket_size: Optional[int]) -> int:
    """Layers FSDP2 gathers ahead of the running one: 1, or the most a layer's explicit prefetch list holds (as
    megalite.distributed.fully_sharded._prefetch makes them: the next layers whose elements fit, at least one)."""
    sizes = [sum(t.numel for t in unit) for unit in units.layers]
    if prefetch_bucket_size is None or len(sizes) < 2:
        return 1
    most = 1
    for i in range(len(sizes) - 1):
        count, total = 0, 0
        for size in sizes[i + 1:]:
            total += size
            if count and total > prefetch_bucket_size:
                break
            count += 1
        most = max(most, count)
    return most


def gathered_bytes(model: ModelConfig, tp: int, dp: int, dtype_bytes: int, pp: int = 1, v: int = 1,
                   pp_rank: int = 0, prefetch_bucket_size: Optional[int] = None, ep: int = 1,
                   expert_tp: Optional[int] = None, split: Optional[tuple[int, ...]] = None) -> float:
    """ZeRO-3's working memory at its peak, in a transformer layer's backward (see the module docstring); an MoE
    layer counts with its experts' unit (gathered over the expert-data-parallel ranks)."""
    units = fully_sharded_units(model, tp, pp, v, pp_rank, ep, expert_tp, split)
    p = dtype_bytes
    tied = not model.untie_embeddings_and_output_weights
    held = 0.0
    for root in units.roots:
        held += padded_elements(root, dp) * p
        # The gradients backward produces first and the root reduces last: output layer (or tied embedding), norm.
        first = [t for t in root if t.name.startswith(("final_norm.", "output_layer."))]
        if tied and first:
            first += [t for t in root if t.name == "embedding.word.weight"]
        held += sum(t.numel for t in first) * p
    # Per element of the largest layer: the running layer and those prefetched (p bytes each; an FP8 weight 1 with
    # --fp8-param-gather), the running one's unsharded gradient (p) and the previous one's reduce-scatter input (4).
    ahead = prefetched_layers(units, prefetch_bucket_size) + 1
    fp8 = 1 if model.fp8_param_gather else p
    return held + max((sum(padded_elements([t], dp) * (ahead * (fp8 if t.fp8 else p) + p + 4) for t in unit)
                       + padded_elements(experts, dp // ep) * (ahead * p + p + 4)
                       for unit, experts in zip(units.layers, units.experts)), default=0)


def _fully_sharded_state_bytes(model: ModelConfig, tp: int, pp: int, v: int, dp: int, offload: bool,
                               offload_params: bool, pp_rank: int, dtype_bytes: int, dp_rank: int,
                               prefetch_bucket_size: Optional[int], experts: tuple[int, int],
                               split: Optional[tuple[int, ...]], muon: bool = False) -> ModelStates:
    ep, expert_tp = experts
    units = fully_sharded_units(model, tp, pp, v, pp_rank, ep, expert_tp, split)
    shards = [(t, shard_rows(t.dim0, dp // ep if t.expert else dp, dp_rank // ep if t.expert else dp_rank)
               * (t.numel // t.dim0)) for t in units.tensors]
    owned = sum(n for _, n in shards)
    matrices = sum(n for t, n in shards if muon and is_muon_matrix(t))   # Muon's one buffer where Adam keeps two
    gathered = gathered_bytes(model, tp, dp, dtype_bytes, pp, v, pp_rank, prefetch_bucket_size, ep, expert_tp, split)
    shard = owned * 4.0                     # fp32, whatever the model dtype
    if offload_params:                      # the optimizer steps the host shards themselves: no main copy
        return ModelStates(0.0, 0.0, 0.0, host_optimizer=owned * 8.0, host_weights=shard, host_gradients=shard,
                           gathered=gathered)
    if offload:                             # Adam and an fp32 main copy of the device shard on the host
        return ModelStates(shard, shard, 0.0, host_optimizer=owned * 12.0, gathered=gathered)
    return ModelStates(shard, shard, owned * 8.0 - matrices * 4.0, gathered=gathered)


# ---- activations ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Numerics:
    """Bytes of what autograd keeps: activation elements, dropout masks, and whether attention is a fused kernel."""
    activation_bytes: int = 2          # bf16
    mask_bytes: int = 1                # CUDA dropout keeps a bool mask
    fused_attention_dropout: bool = True   # flash attention regenerates its dropout mask (the CPU uses the math path)
    flash_attention: bool = True       # False: an unfused core (--use-fused-kernels on) keeps the s x s softmax
    causal_bias_kernel: bool = True    # SDPA runs a lower-right causal bias as a kernel (the CPU spells out a mask)
    unfused_ring_blocks: bool = True   # the p2p ring's blocks are torch ops on a GPU (the CPU has a fused kernel)

    @classmethod
    def gpu(cls, dtype_bytes: int = 2) -> "Numerics":
        return cls(dtype_bytes, 1, True)

    @classmethod
    def cpu(cls, dtype_bytes: int = 4) -> "Numerics":
        """torch on the CPU: dropout keeps its float noise; attention with dropout runs the unfused math path."""
        return cls(dtype_bytes, dtype_bytes, False, causal_bias_kernel=False, unfused_ring_blocks=False)


def _norm_statistics(model: ModelConfig) -> int:
    """fp32 bytes per token one norm keeps besides its input: LayerNorm mean and 1/std, RMSNorm 1/std."""
    return 4 if model.normalization == "RMSNorm" else 8


def layer_activation_bytes(model: ModelConfig, tp: int, sequence_parallel: bool, micro_batch_size: int,
                           numerics: Numerics, recomputed: bool = False, cp: int = 1,
                           cp_comm_type: str = "p2p", index: int = 0, expert_tp: Optional[int] = None) -> float:
    """Bytes one transformer layer (global ``index``: dense or MoE) keeps for backward per micro-batch (see the
    module docstring). ``recomputed``: the layer is inside a full-recompute group (only its input is kept; its
    group's caller counts it). With context parallelism every per-token term is the rank's s / CP tokens' (see
    :func:`context_parallel_core_bytes`)."""
    whole = model.seq_length
    s, b, h, a = whole // cp, micro_batch_size, model.hidden_size, model.num_attention_heads
    index = min(index, model.num_layers - 1)   # multi-token prediction's layers are like the last
    g, d, f = model.query_groups, model.head_dim, model.ffn_size
    p, m = numerics.activation_bytes, numerics.mask_bytes
    sbh = s * b * h
    replicated_share = 1 / tp if sequence_parallel else 1.0
    if recomputed:
        return p * sbh * replicated_share
    modules = model.recomputed_modules()   # selective recompute: core_attn by default, --recompute-modules
    replicated = 4 * p * sbh + 2 * _norm_statistics(model) * s * b
    if "layernorm" in modules:   # the norms' outputs (the QKV and fc1 inputs) and statistics: freed, recomputed
        replicated = 2 * p * sbh
    if model.sandwich_norm:   # each sublayer's output is kept by its post norm, with the norm's statistics
        replicated += 2 * p * sbh + 2 * _norm_statistics(model) * s * b
    if model.hidden_dropout > 0:
        replicated += 2 * m * sbh
    kv_heads = max(g // tp, 1)                       # key/value heads a rank uses (one, shared, when G < TP)
    rope = model.position_embedding_type == "rope"
    split = 0.0
    if model.multi_latent_attention:
        split += latent_attention_bytes(model, tp, s * b, p, replicated_share, "mla_up_proj" in modules)
    elif tp > g:   # a key/value head split over TP/G ranks is gathered into a new [k; v] tensor, which v views
        split += p * s * b * 2 * kv_heads * d
    if not model.multi_latent_attention:
        if tp <= g or not rope:                      # q or v still views the fused QKV output, keeping it whole
            split += p * s * b * (model.query_size + 2 * g * d) / tp
        if model.qk_layernorm:   # the normalized q and k are new tensors, with per-head statistics
            split += p * s * b * (model.query_size / tp + kv_heads * d) + _norm_statistics(model) * s * b * (
                a / tp + kv_heads)
        if rope:
            split += p * s * b * (model.query_size / tp + kv_heads * d) + 2 * p * s * d   # rotated q, k; cos, sin
        split += p * s * b * model.query_size / tp   # the attention output = the output projection's input
    if model.num_experts is not None and model.moe_layers()[index]:   # the rank's s / CP tokens are routed
        if "moe" not in modules:   # (recomputed: its input, the norm output, is all it keeps)
            split += moe_activation_bytes(dataclasses.replace(model, seq_length=s), tp, sequence_parallel,
                                          micro_batch_size, numerics, tp if expert_tp is None else expert_tp)
    elif "mlp" not in modules:
        split += p * s * b * f / tp * (4 if model.gated_mlp else 2)
    core = 0.0
    keeps_output = False   # whether the attention core keeps its output, the output projection's input, itself
    if "core_attn" not in modules:
        heads = a / tp
        dropout = model.attention_dropout > 0
        if cp > 1 and cp_comm_type in ("p2p", "a2a+p2p"):   # the ring's own core: no s x s tensor at all
            core, keeps_output = 4 * b * heads * s, True
        elif model.softmax_type != "vanilla":   # megalite.model.sinks (no CP): the fp32 softmax over each row and
            # its sink, the probabilities in p bytes (the same storage when p = 4), dropout's mask and output, the
            # boolean mask, and grouped queries' keys and values repeated to every head
            pairs = s * whole
            core = heads * b * (4 * s * (whole + 1) + (p * pairs if p != 4 else 0) + ((m + p) * pairs if dropout
                                                                                       else 0)) + pairs
            if max(g // tp, 1) != heads:
                core += 2 * p * b * heads * s * d
        elif not numerics.flash_attention or (dropout and not numerics.fused_attention_dropout):
            # the softmax output, and with dropout its mask and output (the paper's 5as/h; the math path): the
            # rank's queries against every key (allgather: each local chunk against the keys up to its end, at most
            # (2CP + 1) chunk^2 pairs of the 4CP chunk^2)
            pairs = s * whole if cp == 1 or cp_comm_type != "allgather" else (2 * cp + 1) * (whole // (2 * cp)) ** 2
            core = a * pairs * b / tp * (2 * p + m if dropout else p)
        else:
            core, keeps_output = 4 * b * heads * s, cp == 1   # flash attention's log-sum-exp (and its output)
        if cp > 1:
            core += context_parallel_core_bytes(model, tp, micro_batch_size, numerics, cp, cp_comm_type)
    moe_layer = model.num_experts is not None and model.moe_layers()[index]
    fp8 = fp8_saved_difference(model, tp, s * b, replicated_share, p, keeps_output, moe_layer)
    offloaded = offloaded_bytes(model, tp, s * b, numerics, replicated_share, core, moe_layer, expert_tp or tp)
    return replicated * replicated_share + split + core + fp8 - offloaded


def offloaded_bytes(model: ModelConfig, tp: int, tokens: int, numerics: Numerics, replicated_share: float,
                    core: float, moe_layer: bool, expert_tp: int) -> float:
    """What --offload-modules moves off the device per layer and micro-batch (megalite.tensor_parallel.offload;
    measured with saved-tensor hooks, tests/planner/test_memory.py), given the attention ``core``'s kept bytes:
    attn_norm, mlp_norm: the norm's input and statistics (the input only when --recompute-modules layernorm reruns
    it); core_attn: the core's own tensors and the storages of its queries, keys and values (the fused QKV output
    that one of them views, the rotated q and k with rope, a gathered [k; v]; multi-latent attention's per-head q,
    k and key/value up-projection, an estimate); attn_proj: the output projection's input; expert_fc1:
    the experts' input rows; moe_act: what the activation keeps (the fc1 output, and silu's output when gated and
    not rerun)."""
    modules = model.offloaded_modules()
    if not modules:
        return 0.0
    p, h, d, g = numerics.activation_bytes, model.hidden_size, model.head_dim, model.query_groups
    recomputed = model.recomputed_modules()
    norm = p * tokens * h + (0 if "layernorm" in recomputed else _norm_statistics(model) * tokens)
    moved = norm * replicated_share * len(modules & {"attn_norm", "mlp_norm"})
    if "core_attn" in modules:
        heads, kv_heads = model.num_attention_heads / tp, max(g // tp, 1)
        rope = model.position_embedding_type == "rope"
        if model.multi_latent_attention:
            qk = model.qk_head_dim + model.qk_pos_emb_head_dim
            moved += p * tokens * heads * (2 * qk + model.qk_head_dim + model.v_head_dim)
        else:
            if tp <= g or not rope:   # q, k or v views the fused output
                moved += p * tokens * (model.query_size + 2 * g * d) / tp
            if rope:
                moved += p * tokens * (model.query_size / tp + kv_heads * d)
            if tp > g:
                moved += p * tokens * 2 * kv_heads * d
        moved += core
    if "attn_proj" in modules:
        moved += p * tokens * (model.num_attention_heads * model.v_head_dim if model.multi_latent_attention
                               else model.query_size) / tp
    if moe_layer and modules & {"expert_fc1", "moe_act"}:
        rows, f = model.moe_router_topk * tokens, model.expert_ffn_size / expert_tp
        if "expert_fc1" in modules:
            moved += p * rows * h
        if "moe_act" in modules:
            moved += p * rows * f * ((2 if "moe_act" in recomputed else 3) if model.gated_mlp else 1)
    return moved


def fp8_saved_difference(model: ModelConfig, tp: int, tokens: int, replicated_share: float, p: float,
                         core_keeps_output: bool, moe_layer: bool) -> float:
    """What the FP8 linears (tensorwise and delayed) change in a layer's saved bytes against p-byte activations
    (measured with saved-tensor hooks, tests/planner/test_memory.py): each keeps its input quantized, one byte an
    element, instead of the input itself (the query/key/value and first MLP inputs, replicated; the second MLP
    input), except the output projection's, whose input the attention core keeps anyway unless it is recomputed
    (one byte more); and an FP8 copy of its weight slice, one byte an element per micro-batch (none with
    --fp8-param-gather: the linears multiply by the gathered copy), and two fp32 scales. Rowwise keeps the inputs
    and weights as they are: no difference. A routed MoE layer's experts stay bf16."""
    if model.fp8_format is None or model.fp8_recipe == "rowwise":
        return 0.0
    h, q, f = model.hidden_size, model.query_size, model.ffn_size
    qkv = q + 2 * model.query_groups * model.head_dim
    linears, weights = 2, (qkv * h + h * q) / tp
    difference = -(p - 1) * tokens * h * replicated_share                    # the query/key/value input
    difference += tokens * q / tp * (1 if core_keeps_output else -(p - 1))   # the output projection's input
    if not moe_layer:
        linears, weights = 4, weights + ((2 * f if model.gated_mlp else f) * h + f * h) / tp
        difference += -(p - 1) * tokens * h * replicated_share - (p - 1) * tokens * f / tp
    if not model.fp8_param_gather:
        difference += weights
    return difference + 8 * linears


def latent_attention_bytes(model: ModelConfig, tp: int, tokens: int, p: float, replicated_share: float,
                           up_projections_recomputed: bool = False) -> float:
    """What multi-latent attention keeps for backward per micro-batch of ``tokens`` (an estimate from the tensors
    megalite.model.latent_attention makes, not yet measured with saved-tensor hooks): the query latent and the
    key/value latent before and after their norms (replicated, a sequence shard under sequence parallelism), and per
    head the up-projections' outputs, the concatenated (rotated) q and k, the scaled q and the core's output."""
    heads, qk = model.num_attention_heads / tp, model.qk_head_dim + model.qk_pos_emb_head_dim
    latents = 2 * (model.q_lora_rank or 0) + 2 * model.kv_lora_rank + model.qk_pos_emb_head_dim
    per_head = heads * (qk + (model.qk_head_dim + model.v_head_dim) + 2 * qk + qk + model.v_head_dim)
    if up_projections_recomputed:   # --recompute-modules mla_up_proj: all but the core's output freed, recomputed
        per_head = heads * model.v_head_dim
    return p * tokens * (latents * replicated_share + per_head) + 2 * p * model.seq_length * model.qk_pos_emb_head_dim


def context_parallel_core_bytes(model: ModelConfig, tp: int, micro_batch_size: int, numerics: Numerics, cp: int,
                                cp_comm_type: str) -> float:
    """What a context-parallel attention keeps beyond the per-token terms of its s / CP tokens (measured with
    saved-tensor hooks, tests/multiprocess/test_context_parallel.py):

    - p2p (ring): nothing more: it keeps q, k, v, its output and the log-sum-exp, as flash attention does;
    - a2a (and a2a+p2p, whose ring keeps what p2p's does): the core's output in the head-sharded layout, a tensor
      besides the output projection's input;
    - allgather: the whole sequence's keys and values, put in sample order (the core keeps its inputs), and the
      rank's output in its two chunks (each chunk is a core of its own; their concatenation, the output projection's
      input, is counted with the per-token terms); where torch spells out the lower-right causal bias as a mask
      (the CPU: ``Numerics.causal_bias_kernel`` False), SDPA keeps it converted to the activation dtype, p bytes per
      (query, key) pair of the chunks that attend beyond their own block: (2CP + 1) chunk^2 on the ranks but the
      first (2CP chunk^2 there)."""
    s, b, h, p = model.seq_length // cp, micro_batch_size, model.hidden_size, numerics.activation_bytes
    if cp_comm_type == "p2p":
        return 0.0
    if cp_comm_type in ("a2a", "a2a+p2p"):
        return p * b * s * h / tp
    kv_channels = max(model.query_groups // tp, 1) * model.head_dim
    chunk = model.seq_length // (2 * cp)
    masks = 0.0 if numerics.causal_bias_kernel else p * (2 * cp + 1) * chunk * chunk
    return p * b * model.seq_length * 2 * kv_channels + p * b * s * model.query_size / tp + masks


def moe_activation_bytes(model: ModelConfig, tp: int, sequence_parallel: bool, micro_batch_size: int,
                         numerics: Numerics, expert_tp: int) -> float:
    """What an MoE layer keeps beyond the norm output it starts from. Every TP rank routes all of the micro-batch's
    T = s b tokens (under sequence parallelism it keeps the gathered sequence); with k experts a token, dropless and
    balanced, the k T (token, expert) rows: the experts' input, their fc1 output and activation (as the MLP's, at
    the expert hidden size over the experts' TP), the expert outputs and their routing weights kept for the combine,
    and int64 row indices; the router's fp32 scores (and those of the balancing and z losses); the shared expert
    as a dense MLP, with its gate's output."""
    s, b, h = model.seq_length, micro_batch_size, model.hidden_size
    p, tokens, experts = numerics.activation_bytes, s * b, model.num_experts
    rows = model.moe_router_topk * tokens
    glu = 4 if model.gated_mlp else 2
    modules = model.recomputed_modules()
    # --recompute-modules moe_act: the activation's output and what it keeps are freed; the fc1 output stays
    activation = (2 if model.gated_mlp else 1) if "moe_act" in modules else glu
    kept = p * rows * h * 2 + p * rows * model.expert_ffn_size / expert_tp * activation + p * rows + 8 * rows * 3
    losses = (model.moe_router_load_balancing_type != "none" and model.moe_aux_loss_coeff > 0) + \
        (model.moe_z_loss_coeff is not None)
    kept += 4 * tokens * experts * losses + (4 + 8) * tokens * model.moe_router_topk   # scores; top-k weights, ids
    if sequence_parallel and tp > 1:
        kept += p * tokens * h * (1 - 1 / tp)
    shared = model.moe_shared_expert_intermediate_size
    if shared and "shared_experts" not in modules:   # (recomputed: only its input, the MoE layer's)
        share = 1 / tp if sequence_parallel else 1.0
        kept += p * tokens * shared / tp * glu
        if model.moe_shared_expert_gate:
            kept += p * tokens * (h + 1) * share
    return kept


def embedding_activation_bytes(model: ModelConfig, tp: int, sequence_parallel: bool, micro_batch_size: int,
                               numerics: Numerics) -> float:
    """The first virtual stage, per micro-batch: token (and position) ids, and the embedding dropout mask."""
    s, b, h = model.seq_length, micro_batch_size, model.hidden_size
    ids = 8 * s * b + (s * b if tp > 1 else 0)      # int64 ids; under TP also the out-of-range mask (bool)
    if model.learned_positions:
        ids += 8 * s // (tp if sequence_parallel else 1)
    mask = numerics.mask_bytes * s * b * h / (tp if sequence_parallel else 1) if model.hidden_dropout > 0 else 0
    return ids + mask


def output_activation_bytes(model: ModelConfig, tp: int, sequence_parallel: bool, micro_batch_size: int,
                            numerics: Numerics) -> float:
    """The last virtual stage, per micro-batch: final norm input and statistics, output-layer input, the fp32
    softmax over this rank's vocabulary slice, the targets and the loss mask."""
    s, b, h = model.seq_length, micro_batch_size, model.hidden_size
    share = 1 / tp if sequence_parallel else 1.0
    norm = (numerics.activation_bytes * s * b * h + _norm_statistics(model) * s * b) * share
    output_input = numerics.activation_bytes * s * b * h * share
    softmax = 4 * s * b * model.padded_vocab_size(tp) / tp
    targets = 8 * s * b + s * b + 4 * s * b           # int64 local targets, bool out-of-range mask, fp32 loss mask
    return norm + output_input + softmax + targets


def logits_working_bytes(model: ModelConfig, tp: int, micro_batch_size: int, numerics: Numerics) -> float:
    """Transient on the last stage, beyond the fp32 softmax that backward keeps (counted in
    :func:`output_activation_bytes`), per logit. Split over TP: the forward's peak, the logits and an fp32 working
    copy beside the one that becomes the softmax. Whole (torch's cross entropy): the backward's, two fp32 gradients
    of the logits (nll_loss's and log_softmax's) beside the kept log-softmax. Measured on simulated GPUs
    (megalite.simulation) on GPT-2 small; counting the softmax twice had made the planner 5-14% high."""
    tokens_vocab = model.seq_length * micro_batch_size * model.padded_vocab_size(tp) / tp
    return tokens_vocab * (8 if tp == 1 else numerics.activation_bytes + 4)


def ring_block_working_bytes(model: ModelConfig, layout: Layout, numerics: Numerics) -> float:
    """Transient while the p2p ring attends one block on a GPU (unfused, Megatron's way): five fp32 tensors of the
    block's scores at once (the product's copy, masked, shifted, its exponent and a gradient), the rank's s / CP
    queries against a block of as many keys, for its heads. Measured on simulated GPUs (megalite.simulation):
    without it the planner was 10 GiB (18%) short on Llama-2-70B at CP=2, sequence 16384."""
    if layout.cp == 1 or layout.cp_comm_type not in ("p2p", "a2a+p2p") or not numerics.unfused_ring_blocks:
        return 0.0
    a2a = layout.cp_a2a if layout.cp_comm_type == "a2a+p2p" else 1   # a2a+p2p: a2a x the tokens, 1/a2a the heads
    local = model.seq_length // layout.cp * a2a
    return 5 * 4 * layout.micro_batch_size * (model.num_attention_heads // layout.tp // a2a) * local * local


def _chunk_activation_bytes(model: ModelConfig, layout: Layout, num_layers: int, is_first: bool, is_last: bool,
                            numerics: Numerics, first_layer: int = 0) -> tuple[float, float]:
    """(bytes a chunk keeps per micro-batch until its backward, transient bytes of its backward)."""
    tp, sp, b = layout.tp, layout.sequence_parallel, layout.micro_batch_size
    full = [layer_activation_bytes(model, tp, sp, b, numerics, cp=layout.cp, cp_comm_type=layout.cp_comm_type,
                                   index=first_layer + i, expert_tp=layout.expert_tp) for i in range(num_layers)]
    ring = ring_block_working_bytes(model, layout, numerics) if num_layers else 0.0
    # Beyond the layers everything is per token: a context-parallel rank holds s / CP of them.
    model = dataclasses.replace(model, seq_length=model.seq_length // layout.cp)
    kept, transient = 0.0, 0.0
    if model.recompute_granularity == "full":
        n = model.recompute_num_layers
        inputs = layer_activation_bytes(model, tp, sp, b, numerics, recomputed=True)
        if model.recompute_method == "block":    # the first n layers recomputed one by one, the others kept whole
            recomputed = min(n, num_layers)
            kept = recomputed * inputs + sum(full[recomputed:])
            transient = max(full[:recomputed], default=0.0)
        else:                                    # uniform: groups of n layers, each keeping its input
            kept = -(-num_layers // n) * inputs
            transient = max(sum(full[i:i + n]) for i in range(0, num_layers, n)) if num_layers else 0.0
    else:
        kept = sum(full)
    # A recomputed group's backward attends with the group's activations alive; otherwise a block is alone.
    transient = transient + ring if model.recompute_granularity == "full" else max(transient, ring)
    if is_first:
        kept += embedding_activation_bytes(model, tp, sp, b, numerics)
    if is_last:
        kept += output_activation_bytes(model, tp, sp, b, numerics)
        transient = max(transient, logits_working_bytes(model, tp, b, numerics))
        for k in range(model.mtp_num_layers or 0):
            layer = layer_activation_bytes(dataclasses.replace(model, seq_length=model.seq_length * layout.cp), tp,
                                           sp, b, numerics, cp=layout.cp, cp_comm_type=layout.cp_comm_type,
                                           index=model.num_layers + k, expert_tp=layout.expert_tp)
            if model.recompute_granularity == "full":
                transient = max(transient, layer)
                layer = layer_activation_bytes(model, tp, sp, b, numerics, recomputed=True)
            share = 1 / tp if sp else 1.0
            s_b = model.seq_length * b
            modules = (3 * numerics.activation_bytes * s_b * model.hidden_size + 2 * _norm_statistics(model) * s_b)
            kept += (layer + modules * share + embedding_activation_bytes(model, tp, sp, b, numerics)
                     + output_activation_bytes(model, tp, sp, b, numerics))
    # A sent output is freed once its transfer completes (the pipeline engine keeps only its graph): not kept.
    return kept, transient


def weight_gradient_bytes(model: ModelConfig, layout: Layout, num_layers: int, is_last: bool,
                          numerics: Numerics) -> float:
    """Bytes a chunk's deferred W step holds per micro-batch between its B and its W (zero-bubble schedules): each
    linear layer's input, which the forward kept anyway, and the gradient of its output, which the B computed: per
    layer the QKV and fc1 inputs (norm outputs, a sequence shard under sequence parallelism), the projection and fc2
    inputs and the QKV and fc1 output gradients (split over TP), and the projection and fc2 output gradients (whole,
    the row-parallel linears' outputs being partial sums; a sequence shard under sequence parallelism, gathered
    again in the W step); on the last stage the output layer's input and the logits' gradient. FP8 linears keep the
    same tensors, but the row-parallel output gradients whole (their FP8 backward receives the gathered gradient),
    and in one byte an element (tensorwise, delayed: as quantized; rowwise keeps them as they are)."""
    tp, h, f = layout.tp, model.hidden_size, model.ffn_size
    p, sb = numerics.activation_bytes, model.seq_length * layout.micro_batch_size
    share = 1 / tp if layout.sequence_parallel else 1.0
    qkv = h + 2 * model.query_groups * model.head_dim
    inputs = 2 * h * share + h / tp + f / tp
    grads = qkv / tp + 2 * h * (share if model.fp8_format is None else 1.0) + f * (2 if model.gated_mlp else 1) / tp
    linear_bytes = 1 if model.fp8_format is not None and model.fp8_recipe != "rowwise" else p
    total = num_layers * linear_bytes * sb * (inputs + grads)
    if is_last:
        total += p * sb * (h * share + model.padded_vocab_size(tp) / tp)
    return total


def _simulated_micro_batches(pp: int, v: int, num_micro_batches: int) -> int:
    """Enough micro-batches for the schedule to reach its steady state (its peak does not grow beyond it)."""
    if pp == 1:
        return 1
    cap = pp * (v + 2)
    return min(num_micro_batches, cap)


@functools.lru_cache(maxsize=4096)
def peak_in_flight_bytes(pp: int, rank: int, num_micro_batches: int, virtual_stages: int,
                         chunk_bytes: tuple[float, ...], schedule: str = "1f1b",
                         deferred_bytes: Optional[tuple[float, ...]] = None) -> float:
    """Most bytes held at once by micro-batches between their forward and backward on pipeline rank ``rank``,
    chunk c holding ``chunk_bytes[c]`` per micro-batch, in megalite's ``schedule`` for the layout. Where the schedule
    defers weight gradients, a micro-batch holds ``deferred_bytes[c]`` from its B to its W instead."""
    m = _simulated_micro_batches(pp, virtual_stages, num_micro_batches)
    live = peak = 0.0
    for step in build_schedule(pp, rank, m, virtual_stages, schedule):
        deferred = deferred_bytes[step.chunk] if deferred_bytes and schedule != "1f1b" else 0.0
        live += {"F": chunk_bytes[step.chunk], "B": deferred - chunk_bytes[step.chunk], "W": -deferred}[step.kind]
        peak = max(peak, live)
    return peak


def activation_bytes(model: ModelConfig, layout: Layout, pp_rank: int, num_micro_batches: int,
                     numerics: Numerics, transients: bool = True) -> float:
    """Peak activation bytes of one rank of pipeline stage ``pp_rank``: the in-flight micro-batches' kept bytes
    (those waiting for a deferred W step holding what it needs) plus, with ``transients``, the largest transient (a
    recomputed group's backward, or the logits on the last stage)."""
    chunks = chunks_of_rank(layout.split or model.num_layers, layout.pp, layout.virtual_stages, pp_rank,
                            layout.placement)
    kept, transient = zip(*(_chunk_activation_bytes(model, layout, c.num_layers, c.is_first, c.is_last, numerics,
                                                    c.first_layer) for c in chunks))
    deferred = tuple(weight_gradient_bytes(model, layout, c.num_layers, c.is_last, numerics) for c in chunks)
    held = peak_in_flight_bytes(layout.pp, pp_rank, num_micro_batches, layout.virtual_stages, tuple(kept),
                                layout.pipeline_schedule if layout.pp > 1 else "1f1b", deferred)
    return held + (max(transient) if transients else 0.0)


# ---- a whole stage --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageMemory:
    pp_rank: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    host_optimizer: float = 0.0
    gathered: float = 0.0        # ZeRO-3's working memory (see ModelStates)
    host_weights: float = 0.0
    host_gradients: float = 0.0

    @property
    def states(self) -> float:
        """Weights, gradients and optimizer states on the device."""
        return self.weights + self.gradients + self.optimizer

    @property
    def fixed(self) -> float:
        """What does not depend on the micro-batch: the states and ZeRO-3's gathered layers."""
        return self.states + self.gathered

    @property
    def host(self) -> float:
        return self.host_weights + self.host_gradients + self.host_optimizer

    @property
    def total(self) -> float:
        return self.fixed + self.activations


def stage_memory(model: ModelConfig, layout: Layout, pp_rank: int, global_batch_size: int, *,
                 dtype_bytes: int = 2, numerics: Optional[Numerics] = None,
                 bucket_size: Optional[int] = None, prefetch_bucket_size: Optional[int] = None,
                 grad_bytes: int = 4) -> StageMemory:
    """Everything one GPU of pipeline stage ``pp_rank`` holds (DP rank 0, the most loaded)."""
    numerics = numerics or Numerics.gpu(dtype_bytes)
    model = layout.model_config(model) if layout.recompute != model.recompute_granularity else model
    states = model_state_bytes(model, layout, pp_rank, dtype_bytes=dtype_bytes, bucket_size=bucket_size,
                               prefetch_bucket_size=prefetch_bucket_size, grad_bytes=grad_bytes)
    acts = activation_bytes(model, layout, pp_rank, layout.num_micro_batches(global_batch_size), numerics)
    return StageMemory(pp_rank, states.weights, states.gradients, states.optimizer, acts,
                       host_optimizer=states.host_optimizer, gathered=states.gathered,
                       host_weights=states.host_weights, host_gradients=states.host_gradients)


def memory_per_stage(model: ModelConfig, layout: Layout, global_batch_size: int, **kwargs) -> list[StageMemory]:
    return [stage_memory(model, layout, r, global_batch_size, **kwargs) for r in range(layout.pp)]
