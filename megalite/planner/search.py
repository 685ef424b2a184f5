"""The layout search: every layout megalite can run on the GPUs, estimated, the ones that fit ranked by step time.

Search space (each candidate is also passed through megalite.config.validate, so only runnable layouts come out):

- TP in powers of two up to the GPUs of one node; larger TP is rejected, its all-reduces would cross the network;
- PP dividing the number of layers, or a power of two that does not with the uneven split that balances the stages'
  compute (megalite.planner.pipeline_balance; it runs as --pipeline-model-parallel-layout); DP = GPUs / (TP x PP)
  dividing the global batch;
- V in {1, 2} (interleaved 1F1B) when the layers split into PP x V chunks and the micro-batches into groups of PP;
- micro-batch in {1, 2, 4, 8} dividing the per-DP batch;
- plain DP, distributed optimizer (ZeRO-1) or ZeRO-2 (with DP > 1), and ZeRO-3 (FSDP2) when PP = 1 (megalite
  runs it with pipelining too, but the stage-3 time model covers one stage). ZeRO-3 is a candidate like the others,
  not a last resort: it saves the most memory (16/DP bytes per parameter, plus one or two gathered layers) and moves
  the most data (parameters gathered twice and gradients reduce-scattered in every micro-batch), so it wins where its
  memory buys something (no TP or PP, a larger micro-batch, no recompute) and its traffic hides behind compute: fast
  links, large micro-batches;
- sequence parallelism whenever TP > 1 (it only saves memory; its extra all-gather is counted);
- recompute none, selective or full (uniform, one layer per group);
- context parallelism CP in powers of two up to 16, p2p (ring) or a2a (Ulysses): each GPU holds s / CP tokens of
  every sample, so activations shrink by CP, at the price of the ring's K/V transfers (they hide behind the attention
  blocks' compute when blocks are long: compute per block grows with s^2 / CP^2, its bytes with s / CP; but
  megalite's blocks are unfused attention on a GPU, slower than flash) or of a2a's all-to-alls (not hidden; its core is
  flash attention), or a2a+p2p (the all-to-all over A ranks inside a node, a ring over the CP / A groups: what runs
  where a2a cannot, its heads not splitting CP ways, or its all-to-all would cross the network). It wins for long
  sequences, where activations would not fit otherwise or force recompute.
  Searched from 16k tokens on (MIN_CONTEXT_PARALLEL_SEQUENCE); DP = GPUs / (TP x CP x PP).
- with PP > 1 the pipeline schedule: 1f1b, zero-bubble (ZB-H1, interleaved at V = 2) and at V = 2 zbv; a zero-bubble
  schedule wins where its smaller bubble pays for the weight-gradient inputs it holds a while longer;
- for a mixture of experts, EP in powers of two dividing DP x CP and the number of experts (the experts' memory
  shrinks by EP and their gradient reduction runs over DP x CP / EP ranks; the tokens' all-to-alls grow with it).

A layout fits when its most loaded GPU's estimate stays under the device memory minus the headroom. Ranking: step
time; layouts within 0.5% of each other count as tied and the simpler wins (no recompute, then smaller CP, TP, PP,
V and EP, then the larger micro-batch, less communication, less memory). The table keeps the best variant of each
(TP, CP, PP, V).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from megalite.config import ConfigError, MegaliteConfig, ModelConfig, TrainingConfig, validate
from megalite.config.dims import ParallelDims
from megalite.planner.hardware import Hardware, gib
from megalite.planner.layout import Layout
from megalite.planner.memory import Numerics, StageMemory, bytes_per_parameter, memory_per_stage, model_state_bytes
from megalite.planner.parameters import ParameterCount, count_parameters
from megalite.planner.performance import StepTime, step_time
from megalite.planner.pipeline_balance import balanced_pipeline_split

MICRO_BATCH_SIZES = (1, 2, 4, 8)
RECOMPUTE = (None, "selective", "full")
MAX_CONTEXT_PARALLEL = 16
# Context parallelism is searched from this sequence length on: NVIDIA's long-context recipes (NeMo, Llama 3 8B and
# 70B at 16k and 64k) are where it is used; below, it costs search time and does not win.
MIN_CONTEXT_PARALLEL_SEQUENCE = 16384
CP_COMM_TYPES = ("p2p", "a2a")   # allgather holds the whole sequence's K/V and moves as much as p2p: never better
_TIE = 1.005   # step times within 0.5% are a tie


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: tuple[StageMemory, ...]   # one GPU of each pipeline stage
    time: StepTime
    usable_bytes: float
    global_batch_size: int
    seq_length: int

    @property
    def peak(self) -> StageMemory:
        """The most loaded pipeline stage."""
        return max(self.memory, key=lambda stage: stage.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.usable_bytes

    @property
    def tokens_per_second(self) -> float:
        return self.time.tokens_per_second(self.global_batch_size, self.seq_length)

    def mfu(self, hardware: Hardware) -> float:
        return self.time.mfu(hardware)

    def sort_key(self) -> tuple:
        """Step time (0.5% buckets), then the simpler layout (see the module docstring)."""
        lay = self.layout
        communication = self.time.tp + self.time.pp + self.time.dp + self.time.cp + self.time.all_to_all
        return (math.floor(math.log(self.time.step) / math.log(_TIE)), RECOMPUTE.index(lay.recompute), lay.cp,
                lay.tp, lay.pp, lay.virtual_stages, lay.ep, -lay.micro_batch_size, communication, self.peak.total)


@dataclass(frozen=True)
class Rejection:
    """A shape (TP, PP, V) none of whose variants can run or fit, and why."""
    tp: int
    pp: int                  # 0: every PP
    virtual_stages: int
    reason: str

    @property
    def shape(self) -> str:
        if self.pp == 0:
            return f"TP={self.tp}"
        return f"TP={self.tp} x PP={self.pp}" + (f" (V={self.virtual_stages})" if self.virtual_stages > 1 else "")


@dataclass
class Plan:
    model: ModelConfig
    hardware: Hardware
    global_batch_size: int
    parameters: ParameterCount
    ranked: list[Estimate]                      # best variant of each (TP, CP, PP, V) that fits, fastest first
    rejected: list[Rejection]
    fitting: int                                # layouts that fit, all variants
    candidates: int                             # layouts estimated
    model_name: Optional[str] = None
    dtype_bytes: int = 2
    explanation: list[str] = field(default_factory=list)

    @property
    def winner(self) -> Optional[Estimate]:
        return self.ranked[0] if self.ranked else None


def estimate(model: ModelConfig, layout: Layout, hardware: Hardware, global_batch_size: int,
             dtype_bytes: int = 2, numerics: Optional[Numerics] = None) -> Estimate:
    """Memory per stage and step time of one layout (activations as CUDA keeps them unless ``numerics`` says)."""
    memory = memory_per_stage(model, layout, global_batch_size, dtype_bytes=dtype_bytes, numerics=numerics)
    time = step_time(model, layout, hardware, global_batch_size, dtype_bytes)
    return Estimate(layout, tuple(memory), time, hardware.usable_memory_bytes, global_batch_size, model.seq_length)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def _context_exchanges(tp: int, cp: int, gpus_per_node: int) -> list[tuple[str, int]]:
    """(comm type, a2a ranks) to try at CP = ``cp``: p2p and a2a, and a2a+p2p with its all-to-all on A ranks inside
    a node (TP x A GPUs, A from 2 to CP / 2) and the ring over the CP / A groups."""
    if cp == 1:
        return [("p2p", 1)]
    inner = [a for a in _powers_of_two(cp // 2) if a > 1 and cp % a == 0 and tp * a <= gpus_per_node]
    return [(kind, 1) for kind in CP_COMM_TYPES] + [("a2a+p2p", a) for a in inner]


def _variants(dims: ParallelDims, v: int, global_batch_size: int, num_experts: Optional[int] = None,
              split: Optional[tuple[int, ...]] = None, gpus_per_node: int = 8):
    """Every micro-batch size, optimizer sharding, recompute option, context-parallel exchange, pipeline schedule
    (zbv: its v-shape at V = 2) and (for a mixture of experts) expert-parallel size of one (TP, CP, PP, V) shape."""
    tp, cp, pp, dp = dims.tp, dims.cp, dims.pp, dims.dp
    per_replica = global_batch_size // dp
    schedules = ("1f1b", "zero-bubble") + (("zbv",) if v == 2 else ()) if pp > 1 else ("1f1b",)
    replicas = dims.dp_cp
    expert_parallel = ([ep for ep in _powers_of_two(replicas) if replicas % ep == 0 and num_experts % ep == 0]
                       if num_experts else [1])
    for mbs in MICRO_BATCH_SIZES:
        if per_replica % mbs or (v > 1 and (per_replica // mbs) % pp):
            continue
        for zero in ((0, 1, 2) + ((3,) if pp == 1 else ()) if replicas > 1 else (0,)):
            for recompute in RECOMPUTE:
                for comm_type, cp_a2a in _context_exchanges(tp, cp, gpus_per_node):
                    for schedule in schedules:
                        for ep in expert_parallel:
                            yield Layout(tp=tp, pp=pp, dp=dp, virtual_stages=v, micro_batch_size=mbs, zero=zero,
                                         sequence_parallel=tp > 1, recompute=recompute, cp=cp,
                                         cp_comm_type=comm_type, cp_a2a=cp_a2a, pipeline_schedule=schedule, ep=ep,
                                         split=split)


def search(model: ModelConfig, hardware: Hardware, global_batch_size: int, *, model_name: Optional[str] = None,
           dtype_bytes: int = 2, numerics: Optional[Numerics] = None) -> Plan:
    """Estimate every candidate layout and rank those that fit (see the module docstring)."""
    n, layers = hardware.num_gpus, model.num_layers
    best: dict[tuple[int, int, int, int], Estimate] = {}
    rejected: list[Rejection] = []
    fitting = candidates = 0
    for tp in _powers_of_two(n):
        if tp > hardware.gpus_per_node:
            rejected.append(Rejection(tp, 0, 1, f"more than the {hardware.gpus_per_node} GPUs of a node: its "
                                                f"all-reduces, 4 per layer and micro-batch, would cross the network"))
            continue
        max_cp = MAX_CONTEXT_PARALLEL if model.seq_length >= MIN_CONTEXT_PARALLEL_SEQUENCE else 1
        stage_counts = sorted({d for d in range(1, layers + 1) if layers % d == 0} |
                              {p for p in _powers_of_two(min(layers, n)) if p > 1})
        for dims in (ParallelDims(n, tp, c, d) for c in _powers_of_two(min(n // tp, max_cp)) for d in stage_counts):
            if not dims.whole_replicas:
                continue
            cp, pp, dp = dims.cp, dims.pp, dims.dp
            if global_batch_size % dp:
                if cp == 1:   # a context-parallel shape is only reported when it is the one that runs
                    rejected.append(Rejection(tp, pp, 1, f"global batch {global_batch_size} does not split over "
                                                         f"DP={dp}"))
                continue
            split = None if layers % pp == 0 else balanced_pipeline_split(model, pp)
            for v in ((1, 2) if split is None and pp > 1 and layers % (2 * pp) == 0 else (1,)):
                error, smallest = None, None
                run = MegaliteConfig(model=model, training=TrainingConfig(global_batch_size=global_batch_size,
                                                                          bf16=dtype_bytes == 2))
                key = (tp, cp, pp, v)
                for layout in _variants(dims, v, global_batch_size, model.num_experts, split,
                                          hardware.gpus_per_node):
                    try:
                        validate(layout.apply(run), n)
                    except ConfigError as e:
                        error = error or str(e)
                        continue
                    candidates += 1
                    result = estimate(model, layout, hardware, global_batch_size, dtype_bytes, numerics)
                    if not result.fits:
                        if smallest is None or result.peak.total < smallest.peak.total:
                            smallest = result
                        continue
                    fitting += 1
                    if key not in best or result.sort_key() < best[key].sort_key():
                        best[key] = result
                if key in best or cp > 1:
                    continue
                if smallest is not None:
                    rejected.append(Rejection(tp, pp, v, _memory_reason(smallest)))
                elif error is not None:
                    rejected.append(Rejection(tp, pp, v, error))
                elif v == 1:
                    rejected.append(Rejection(tp, pp, v, f"no micro-batch size in {MICRO_BATCH_SIZES} divides the "
                                                         f"{global_batch_size // dp} samples per DP rank"))
    ranked = sorted(best.values(), key=Estimate.sort_key)
    plan = Plan(model, hardware, global_batch_size, count_parameters(model), ranked, rejected, fitting, candidates,
                model_name, dtype_bytes)
    plan.explanation = explain(plan)
    return plan


def _memory_reason(smallest: Estimate) -> str:
    peak, usable = smallest.peak, smallest.usable_bytes
    where = f"stage {peak.pp_rank}" if smallest.layout.pp > 1 else "each GPU"
    gathered = f" + {gib(peak.gathered)} gathered layers" if peak.gathered else ""
    if peak.fixed > usable:
        return (f"model states alone need {gib(peak.states)}{gathered} on {where} (even with "
                f"{smallest.layout.optimizer_name}), more than the {gib(usable)} usable")
    return (f"needs {gib(peak.total)} on {where} ({gib(peak.states)} model states{gathered} + "
            f"{gib(peak.activations)} activations) at best ({smallest.layout.describe()}), more than the "
            f"{gib(usable)} usable")


# ---- why the winner wins --------------------------------------------------------------------------------------------

def _percent(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:.0f}%"


def _components(e: Estimate) -> dict[str, float]:
    t = e.time
    return {"the pipeline bubble": t.bubble_time, "tensor-parallel communication": t.tp, "pipeline transfers": t.pp,
            "exposed data-parallel communication": t.dp_exposed, "recompute": t.recompute,
            "exposed context-parallel communication": t.cp_exposed,
            "the slowest stage's extra work (the output layer)": t.imbalance}


def _link(hw: Hardware, span: int) -> str:
    """The slowest link a ring over ``span`` consecutive ranks crosses, named, with its bandwidth."""
    slower_network = span > hw.gpus_per_node and hw.inter_bandwidth < hw.intra_bandwidth
    name = hw.inter_node_network if slower_network else "PCIe" if hw.intra_node_link == "pcie" else "NVLink"
    return f"{name} ({hw.bandwidth(span) / 1e9:g} GB/s)"


def _why_not_pure_data_parallel(plan: Plan) -> str:
    pure = [e for e in plan.ranked if e.layout.tp == 1 and e.layout.pp == 1 and e.layout.cp == 1]
    if pure:
        return f"Pure data parallelism fits but is {_percent(pure[0].time.step, plan.winner.time.step)} slower"
    hw, n = plan.hardware, plan.hardware.num_gpus
    sharded = Layout(dp=n, zero=3 if n > 1 else 0)   # the least memory data parallelism alone can hold
    states = model_state_bytes(plan.model, sharded, dtype_bytes=plan.dtype_bytes)
    held = states.total + states.gathered
    gathered = " and gathered layers" if states.gathered else ""
    if held > hw.usable_memory_bytes:
        return (f"Data parallelism alone does not fit: the model states{gathered} need {gib(held)} per GPU even "
                f"with {sharded.optimizer_name} ({gib(hw.usable_memory_bytes)} usable)")
    return (f"Data parallelism alone does not fit: the model states{gathered} ({gib(held)} per GPU with "
            f"{sharded.optimizer_name}) leave too little room for the activations even with full recompute")


def _why_context_parallel(plan: Plan) -> str:
    """What CP buys the winner: the activations without it, and what its ring costs."""
    w, hw = plan.winner, plan.hardware
    lay, peak, t = w.layout, w.peak, w.time
    # The same GPUs as data parallelism instead (the micro-batch shrinks if the batch splits no further).
    mbs = max(1, min(lay.micro_batch_size, plan.global_batch_size // lay.replicas))
    without = estimate(plan.model, dataclasses.replace(lay, cp=1, dp=lay.replicas, micro_batch_size=mbs), hw,
                       plan.global_batch_size, plan.dtype_bytes) \
        if plan.global_batch_size % (lay.replicas * mbs) == 0 else None
    if without is None:
        instead = "the batch does not split over that many data-parallel ranks"
    else:
        verdict = "would not fit" if not without.fits else f"would take {_percent(without.time.step, t.step)} longer"
        instead = f"data parallelism over those GPUs instead holds {gib(without.peak.activations)} and {verdict}"
    link = _link(hw, lay.tp * lay.cp)
    cost = (f"the ring's K/V transfers over {link}, {t.cp:.2g} s per step, hide behind the attention blocks but for "
            f"{t.cp_exposed:.2g} s" if lay.cp_comm_type == "p2p" else
            f"its {lay.cp_comm_type} exchanges over {link} take {t.cp:.2g} s per step")
    return (f"CP={lay.cp} splits each sample's {plan.model.seq_length:,} tokens over {lay.cp} GPUs: "
            f"{gib(peak.activations)} of activations per GPU, where {instead}; {cost}.")


def explain(plan: Plan) -> list[str]:
    """Two or three plain sentences on why the first row wins."""
    w = plan.winner
    hw = plan.hardware
    if w is None:
        return [f"No layout fits {hw.num_gpus} GPUs of {hw.gpu_memory_gib:g} GiB: more GPUs, GPUs with more memory, "
                f"a shorter sequence or --optimizer-cpu-offload (with --zero-stage 3, also --offload-params; not "
                f"searched) are needed."]
    lay, peak = w.layout, w.peak
    first = (f"{lay.describe()} is the fastest layout that fits: {gib(peak.total)} of the {gib(w.usable_bytes)} "
             f"usable on its most loaded GPU, about {w.time.step:.3g} s per step ({w.tokens_per_second:,.0f} tokens/s, "
             f"{w.mfu(hw):.0%} MFU).")
    sentences = [first]
    if lay.cp > 1:
        sentences.append(_why_context_parallel(plan))
    unsplit = lay.tp == 1 and lay.pp == 1   # the model whole on every GPU
    if unsplit and lay.cp == 1 and lay.zero == 3:
        sentences.append(
            f"ZeRO-3 shards everything over the {lay.dp} GPUs ({bytes_per_parameter(3, lay.dp):.3g} bytes per "
            f"parameter = {gib(peak.states)}, plus {gib(peak.gathered)} of layers gathered at a time), so pure data "
            f"parallelism fits: no tensor-parallel all-reduces, no pipeline bubble; FSDP2's gathers and "
            f"reduce-scatters over {_link(hw, lay.dp)}, {w.time.dp:.2g} s per step, hide behind compute but "
            f"for {w.time.dp_exposed:.2g} s.")
    elif unsplit and lay.cp == 1:
        bpp = bytes_per_parameter(lay.zero, lay.dp, plan.dtype_bytes)
        sentences.append(
            f"The model states fit on one GPU ({bpp:.3g} bytes per parameter x {plan.parameters.total / 1e9:.2f}B "
            f"parameters = {gib(peak.states)} with {lay.optimizer_name}), so pure data parallelism wins: no "
            f"tensor-parallel all-reduces, no pipeline bubble, and the gradient reduction ({w.time.dp:.2g} s per step) "
            f"hides behind backward but for {w.time.dp_exposed:.2g} s.")
    elif not unsplit:
        how = []
        if lay.tp > 1:
            how.append(f"TP={lay.tp} inside a node over {hw.intra_node_link} ({hw.intra_bandwidth / 1e9:g} GB/s) "
                       f"costs {w.time.tp:.2g} s per step in all-reduces ({w.time.tp / w.time.step:.0%})")
        if lay.pp > 1:
            how.append(f"PP={lay.pp} adds a {w.time.bubble:.1%} bubble")
        tp_rows = [e for e in plan.ranked if e.layout.tp > max(2, lay.tp)]
        if hw.intra_node_link == "pcie" and tp_rows:
            how.append(f"TP={tp_rows[0].layout.tp} would spend {tp_rows[0].time.tp:.2g} s per step in all-reduces over "
                       f"PCIe ({hw.intra_bandwidth / 1e9:g} GB/s)")
        sentences.append(f"{_why_not_pure_data_parallel(plan)}, so the model is split: {'; '.join(how)}.")
    runner_up = next((e for e in plan.ranked[1:]), None)
    if runner_up is not None:
        mine, theirs = _components(w), _components(runner_up)
        name = max(theirs, key=lambda k: theirs[k] - mine[k])
        delta = theirs[name] - mine[name]
        if delta > 0:
            because = f"{name}, {theirs[name]:.2g} s per step there against {mine[name]:.2g} s"
        else:
            because = "it needs more of everything a little"
        slower = _percent(runner_up.time.step, w.time.step)
        sentences.append(f"The runner-up, {runner_up.layout.describe()}, is {slower} slower: {because}.")
    return sentences
