"""The column- and row-parallel linears' three products in FP8 (megalite.tensor_parallel.fp8 for the numerics):
y = x W^T forward, dx = dy W and dW = dy^T x backward, each quantize -> scaled product -> dequantize, with the
master weight, the activations and the gradients outside these products in bf16.

Every scale is the one a single process would use for the whole tensor: where an amax spans a dimension that TP
splits, it is the max over the TP group (one small all-reduce). Tensorwise, a column-parallel weight and output
gradient are split (by output rows) and a row-parallel weight and input (by input columns); rowwise, the amax is
along each product's inner dimension, split in a row-parallel forward and a column-parallel input gradient.

With sequence parallelism a column-parallel linear quantizes its sequence shard and all-gathers it in FP8 (as
uint8, which every backend carries: gloo refuses FP8 types): half the bf16 traffic. Tensorwise and delayed, its
weight gradient re-gathers that FP8 shard; rowwise, whose weight gradient scales x per column over all tokens,
re-gathers the bf16 shard.

Delayed scaling (:class:`Fp8History`, one per linear): during a step the scales come from the amax history of the
steps before it, so the products need no all-reduce; each forward and backward records the running amax of its
input, weight and output gradient, and :func:`update_delayed_scales`, once the step's backward is done (before the
optimizer step, whose FP8 parameter gather quantizes with the new scales), takes the max over TP and DP x CP ranks
(every rank holding the layer then agrees, and the scale of a step is that of the global batch whatever the
layout), pushes it into the history and computes the next scales. The first step, with no history yet, scales
tensorwise.

A weight is quantized once per version and scale, not once per micro-batch: its FP8 copy (with the amax recorded
for the delayed history) is kept on the weight and reused while neither the weight (its ``_version``, its storage,
and :func:`weights_updated`, which the data-parallel engine calls after writing the weights in its flat buffers,
writes the weight's version counter does not see) nor the scale's source (the history's scales, replaced each step)
changed: every micro-batch of a step multiplies by the same bytes the first one made. A cache hit skips the
weight's amax and its TP all-reduce; every TP rank hits or misses alike, as they write their weights alike. Off at
ZeRO-3 (``cache_weight``), whose point is not to hold whole weights between layers.

With ``--fp8-param-gather`` the distributed optimizer quantizes each weight's updated shard itself and all-gathers
the FP8 bytes (megalite.distributed.fp8_param_gather); it hangs a :class:`GatheredFp8Weight` on the weight, which
the forward multiplies by instead of quantizing the weight: the same bytes and scale it would have computed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from megalite import parallel_state
from megalite.parallel_state import GroupInfo
from megalite.tensor_parallel.fp8 import Fp8Recipe, amax, quantize, scale_from_amax, scaled_mm
from megalite.tensor_parallel.mappings import SEQUENCE_DIM, all_gather, reduce_scatter
from megalite.tensor_parallel.weight_grad import WeightGradStore

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2   # rows of an Fp8History
ROLES = ("input", "weight", "grad_output")


class Fp8History:
    """A linear's amax history (delayed scaling): ``history`` [3, len] (input, weight, output gradient; the most
    recent step first), the ``scales`` they give, the ``running`` amax of the step under way, and how many ``steps``
    were recorded. Plain tensors, not buffers: casting the model to bf16 leaves them fp32."""

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe
        self.history = torch.zeros(3, recipe.amax_history_len)
        self.scales = torch.ones(3)
        self.running = torch.zeros(3)
        self.steps = 0

    def to(self, device: torch.device) -> "Fp8History":
        if self.history.device != device:
            self.history, self.scales, self.running = (t.to(device) for t in (self.history, self.scales,
                                                                                self.running))
        return self

    def record(self, role: int, value: torch.Tensor) -> None:
        self.running[role] = torch.maximum(self.running[role], value.detach().amax())

    def push(self, amaxes: torch.Tensor) -> None:
        """End of a step: ``amaxes`` [3] (already the max over every rank holding the layer) enters the history."""
        r = self.recipe
        self.history = torch.roll(self.history, 1, dims=1)
        self.history[:, 0] = amaxes
        chosen = self.history.amax(dim=1) if r.amax_compute_algo == "max" else self.history[:, 0]
        dtypes = (r.forward_dtype, r.forward_dtype, r.backward_dtype)
        fresh = torch.stack([scale_from_amax(chosen[i], dtypes[i], r.margin) for i in range(3)])
        self.scales = torch.where(chosen > 0, fresh, self.scales)   # a tensor seen as all zeros keeps its scale
        self.running = torch.zeros_like(self.running)
        self.steps += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"history": self.history.clone(), "scales": self.scales.clone(),
                "steps": torch.tensor(self.steps, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if tuple(state["history"].shape) != tuple(self.history.shape):
            raise ValueError(f"an FP8 amax history of shape {tuple(state['history'].shape)} cannot load into "
                             f"{tuple(self.history.shape)} (another --fp8-amax-history-len)")
        device = self.history.device
        self.history, self.scales = state["history"].to(device).clone(), state["scales"].to(device).clone()
        self.steps = int(state["steps"])
        self.running = torch.zeros_like(self.running)


GATHERED = "fp8_gathered"   # the attribute of a weight that holds its GatheredFp8Weight


@dataclass
class GatheredFp8Weight:
    """A weight's FP8 copy as the parameter gather brought it: ``values`` (e4m3, the weight's shape) and the inverse
    of the scale they were quantized by. ``version`` is the weight's version counter when they were made: a weight
    written since (a checkpoint loaded into it) is quantized afresh instead."""
    values: torch.Tensor
    inverse_scale: torch.Tensor
    version: int


def gathered_fp8_weight(weight: torch.Tensor) -> Optional[GatheredFp8Weight]:
    """The weight's gathered FP8 copy, if it has one that is current."""
    gathered = getattr(weight, GATHERED, None)
    return gathered if gathered is not None and gathered.version == weight._version else None


def _max_over(value: torch.Tensor, reduce: bool) -> torch.Tensor:
    """``value`` maxed over the TP group when ``reduce`` (the amax spans a dimension TP splits)."""
    return parallel_state.get_tensor_model_parallel_group().max(value.contiguous()) if reduce else value


def _gather_fp8(q: torch.Tensor) -> torch.Tensor:
    """All-gather an FP8 tensor along the sequence as its bytes (gloo has no FP8 types)."""
    return all_gather(q.view(torch.uint8), SEQUENCE_DIM).view(q.dtype)


WEIGHT_CACHE = "fp8_weight_cache"   # the attribute of a weight that holds its _CachedWeight copies
_generation = 0   # bumped by weights_updated


def weights_updated() -> None:
    """The weights were written where their version counters do not see it (the data-parallel engine's flat
    buffers, after an optimizer step): every cached FP8 weight is stale."""
    global _generation
    _generation += 1


@dataclass
class _CachedWeight:
    """A weight's FP8 copy for one way of quantizing it: made at ``stamp`` (generation, weight version, storage)
    with the history's ``scales`` (delayed) or from the weight's own amax (``scales`` None); ``amax`` is what a
    tracking pass records for it (None until one needs it, when the scale came from the history)."""
    stamp: tuple[int, int, int]
    scales: Optional[torch.Tensor]
    values: torch.Tensor
    inverse_scale: torch.Tensor
    amax: Optional[torch.Tensor]


class _Plan:
    """What one linear's products need to know: the recipe, its history (delayed), its kind ("column" or "row"),
    whether its input is a sequence shard to gather, whether this call records amaxes, and the weight's gathered FP8
    copy (--fp8-param-gather; its amax was recorded when it was made)."""

    def __init__(self, recipe: Fp8Recipe, history: Optional[Fp8History], kind: str, gather_sequence: bool,
                 record: bool, gathered: Optional[GatheredFp8Weight] = None,
                 store: Optional[WeightGradStore] = None, cache_weight: bool = True):
        self.recipe, self.history, self.kind, self.gathered, self.store = recipe, history, kind, gathered, store
        self.gather_sequence, self.record = gather_sequence, record
        self.cache_weight = cache_weight and not torch.is_inference_mode_enabled()   # (inference tensors cannot
        # be saved for a later backward)
        self.split = parallel_state.get_tensor_model_parallel_world_size() > 1
        delayed = recipe.recipe == "delayed"
        self.use_history = delayed and history is not None and history.steps > 0
        self.track = delayed and history is not None and record

    def scale(self, role: int, x: torch.Tensor, dtype: torch.dtype, split: bool,
              inner_dim: Optional[int] = None) -> torch.Tensor:
        """The scale of ``x`` in its ``role``: from the history (delayed, after the first step), else the current
        amax (of the whole tensor, or along ``inner_dim`` for rowwise), maxed over TP where ``split``; its amax
        recorded in the history (delayed, a training pass)."""
        current, scale = self.measure(role, x, dtype, split, inner_dim)
        if self.track:
            self.history.record(role, current)
        return scale

    def measure(self, role: int, x: torch.Tensor, dtype: torch.dtype, split: bool,
                inner_dim: Optional[int] = None) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """(the amax of ``x`` to record, None where the scale comes from the history and nothing records; the
        scale), as :meth:`scale`, which records it."""
        if self.use_history:
            return (amax(x) if self.track else None), self.history.scales[role]
        current = _max_over(amax(x, inner_dim), split and self.split)
        return current, scale_from_amax(current, dtype, self.recipe.margin)


def _quantized(plan: _Plan, role: int, x: torch.Tensor, dtype: torch.dtype, split: bool,
               inner_dim: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, inverse scale) of ``x``."""
    scale = plan.scale(role, x, dtype, split, inner_dim)
    return quantize(x, scale, dtype), scale.reciprocal()


def _quantized_weight(plan: _Plan, weight: torch.Tensor, dtype: torch.dtype, split: bool,
                      inner_dim: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, inverse scale) of the weight: its cached copy while the weight and the scale's source are as they
    were when it was made (see the module docstring), else quantized afresh and cached. The same bytes and scale
    either way, and the same amax recorded (a max: recording it again changes nothing)."""
    if not plan.cache_weight:
        return _quantized(plan, WEIGHT, weight, dtype, split, inner_dim)
    cache = getattr(weight, WEIGHT_CACHE, None)
    if cache is None:
        cache = {}
        setattr(weight, WEIGHT_CACHE, cache)
    key = (dtype, plan.recipe.margin, inner_dim, split and plan.split)
    stamp = (_generation, weight._version, weight.data_ptr())
    scales = plan.history.scales if plan.use_history else None
    entry = cache.get(key)
    if entry is None or entry.stamp != stamp or entry.scales is not scales:
        cache.pop(key, None)   # the stale copy goes before the new one is made
        current, scale = plan.measure(WEIGHT, weight, dtype, split, inner_dim)
        entry = cache[key] = _CachedWeight(stamp, scales, quantize(weight, scale, dtype), scale.reciprocal(), current)
    elif plan.track and entry.amax is None:
        entry.amax = amax(weight)
    if plan.track:
        plan.history.record(WEIGHT, entry.amax)
    return entry.values, entry.inverse_scale


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T with the three products in FP8; ``x`` is [..., in] (with ``gather_sequence``: this rank's sequence
    shard [batch, seq / TP, in]), ``weight`` [out, in] this rank's slice."""

    @staticmethod
    def forward(ctx, x, weight, plan: _Plan):
        r = plan.recipe
        fwd, column, row = r.forward_dtype, plan.kind == "column", plan.kind == "row"
        if r.recipe == "rowwise":
            # Inner dimension: the input features, split over TP in a row-parallel linear.
            x_q, x_inv = _quantized(plan, INPUT, x, fwd, split=row, inner_dim=-1)
            w_q, w_inv = _quantized_weight(plan, weight, fwd, split=row, inner_dim=1)
            saved_x = x   # the weight gradient scales x per column (over tokens): kept in bf16
        else:
            # A column-parallel input is whole (or a sequence shard, then the amax is over TP); a row-parallel one
            # is split by columns. Both linears split their weight.
            x_q, x_inv = _quantized(plan, INPUT, x, fwd, split=row or plan.gather_sequence)
            if plan.gathered is not None:
                w_q, w_inv = plan.gathered.values, plan.gathered.inverse_scale
            else:
                w_q, w_inv = _quantized_weight(plan, weight, fwd, split=True)
            saved_x = x_q
        if plan.gather_sequence:
            x_q = _gather_fp8(x_q)
            if x_inv.dim() > 0:
                x_inv = all_gather(x_inv, SEQUENCE_DIM)
        lead = x_q.shape[:-1]
        rows = x_q.reshape(-1, x_q.shape[-1])
        y = scaled_mm(rows, w_q.t(), x_inv.reshape(-1, 1) if x_inv.dim() else x_inv,
                      w_inv.reshape(1, -1) if w_inv.dim() else w_inv, x.dtype)
        ctx.plan, ctx.column, ctx.x_dtype, ctx.w_dtype, ctx.lead = plan, column, x.dtype, weight.dtype, lead
        ctx.weight = weight   # whose gradient a zero-bubble W step may take over
        if r.recipe == "rowwise":
            ctx.save_for_backward(saved_x, weight)
        else:   # FP8 copies of x and W: half the bytes of bf16, and the backward uses the forward's quantization
            ctx.save_for_backward(saved_x, w_q, w_inv, x_inv)
        # [tokens, out]; the caller restores the leading dims (a view made here could not be summed in place by
        # the row-parallel all-reduce).
        return y

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        r = plan.recipe
        bwd, fwd = r.backward_dtype, r.forward_dtype
        g = grad
        grad_input = grad_weight = None
        # A zero-bubble B step leaves the weight gradient to its W step (megalite.tensor_parallel.weight_grad),
        # with what it needs: the output gradient as quantized here and the input as the forward kept it.
        store = plan.store
        defer = store is not None and store.defers(ctx.weight)
        if r.recipe == "rowwise":
            x, weight = ctx.saved_tensors
            # Input gradient dy [T, out] W [out, in]: inner dimension the outputs, split in a column-parallel linear.
            g_q, g_inv = _quantized(plan, GRAD_OUTPUT, g, bwd, split=ctx.column, inner_dim=1)
            w_q, w_inv = _quantized_weight(plan, weight, fwd, split=ctx.column, inner_dim=0)
            grad_input = scaled_mm(g_q, w_q, g_inv, w_inv, ctx.x_dtype)
            compute, args = functools.partial(_rowwise_weight_gradient, plan, ctx.w_dtype), (g, x)
        else:
            x_q, w_q, w_inv, x_inv = ctx.saved_tensors
            g_q, g_inv = _quantized(plan, GRAD_OUTPUT, g, bwd, split=ctx.column)
            grad_input = scaled_mm(g_q, w_q, g_inv, w_inv, ctx.x_dtype)
            compute = functools.partial(_weight_gradient, plan.gather_sequence, ctx.w_dtype)
            args = (g_q, g_inv, x_q, x_inv)
        if defer:
            store.defer(ctx.weight, compute, *args)
        else:
            grad_weight = compute(*args)
        grad_input = grad_input.reshape(*ctx.lead, grad_input.shape[-1])
        if plan.gather_sequence:
            grad_input = reduce_scatter(grad_input, SEQUENCE_DIM)
        return grad_input, grad_weight, None


def _weight_gradient(gather_sequence: bool, dtype: torch.dtype, g_q: torch.Tensor, g_inv: torch.Tensor,
                     x_q: torch.Tensor, x_inv: torch.Tensor) -> torch.Tensor:
    """dW = dy^T x from the quantized output gradient [T, out] and input (a sequence shard, gathered here)."""
    if gather_sequence:
        x_q = _gather_fp8(x_q)
    return scaled_mm(g_q.t(), x_q.reshape(-1, x_q.shape[-1]), g_inv, x_inv, dtype)


def _rowwise_weight_gradient(plan: _Plan, dtype: torch.dtype, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dy^T [out, T] x [T, in], rowwise: the inner dimension is the tokens (never split over TP), so both
    operands are quantized again, per column of dy and of x (the input a sequence shard, gathered here)."""
    r = plan.recipe
    if plan.gather_sequence:
        x = all_gather(x, SEQUENCE_DIM)
    x = x.reshape(-1, x.shape[-1])
    gt_q, gt_inv = _quantized(plan, GRAD_OUTPUT, g.t(), r.backward_dtype, split=False, inner_dim=1)
    xt_q, xt_inv = _quantized(plan, INPUT, x, r.forward_dtype, split=False, inner_dim=0)
    return scaled_mm(gt_q, xt_q, gt_inv, xt_inv, dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, history: Optional[Fp8History], kind: str,
               gather_sequence: bool = False, record: bool = True,
               store: Optional[WeightGradStore] = None, cache_weight: bool = True) -> torch.Tensor:
    """x W^T in FP8 (see the module docstring); ``kind`` "column" or "row"; ``record``: a training pass, whose
    amaxes enter the delayed history; ``store``: where a zero-bubble B step defers the weight gradient;
    ``cache_weight``: keep the weight's FP8 copy for the next micro-batches."""
    if history is not None:
        history.to(x.device)
    gathered = gathered_fp8_weight(weight) if recipe.recipe != "rowwise" else None
    y = _Fp8Linear.apply(x, weight, _Plan(recipe, history, kind, gather_sequence, record, gathered, store,
                                          cache_weight))
    lead = x.shape[:-1] if not gather_sequence else (*x.shape[:SEQUENCE_DIM], -1, *x.shape[SEQUENCE_DIM + 1:-1])
    return y.view(*lead, y.shape[-1])


@torch.no_grad()
def gathered_weight_scales(linears: list[torch.nn.Module], amaxes: torch.Tensor,
                           groups: Iterable[GroupInfo]) -> list[torch.Tensor]:
    """The scale of each FP8 linear's weight for a parameter gather that quantizes it piece by piece
    (--fp8-param-gather), ``amaxes`` [len(linears)] holding the amax of this rank's piece of each: the whole
    weight's, as the forward would compute it. From the history (delayed, after its first step: no collective),
    else fp8_max / amax with the amaxes maxed over ``groups`` (the ranks holding the other pieces, and TP), one
    all-reduce each for all weights. The amax is recorded as the step's weight amax (update_delayed_scales maxes
    it over the ranks like every other)."""
    from_history = [linear.fp8_history is not None and linear.fp8_history.steps > 0 for linear in linears]
    if not all(from_history):   # the same on every rank: the histories are
        for info in groups:
            info.max(amaxes)
    scales = []
    for linear, historic, value in zip(linears, from_history, amaxes):
        history = linear.fp8_history
        scales.append(history.scales[WEIGHT] if historic
                      else scale_from_amax(value, linear.fp8.forward_dtype, linear.fp8.margin))
        if history is not None:
            history.to(value.device).record(WEIGHT, value)
    return scales


def fp8_histories(modules: Iterable[torch.nn.Module]) -> list[tuple[str, Fp8History]]:
    """(module name, history) of every FP8 linear in ``modules`` (model chunks), in a fixed order."""
    found = []
    for chunk in modules:
        for name, module in chunk.named_modules():
            history = getattr(module, "fp8_history", None)
            if history is not None:
                found.append((name, history))
    return found


def update_delayed_scales(found: list[tuple[str, Fp8History]], groups: Iterable[GroupInfo]) -> None:
    """Once a step's backward is done: every history's running amaxes, maxed over ``groups`` (TP and DP x CP: the
    ranks holding those layers), enter the history; one all-reduce per group for all of them."""
    if not found:
        return
    running = torch.stack([history.running for _, history in found])
    for info in groups:
        info.max(running)
    for (_, history), amaxes in zip(found, running):
        history.push(amaxes)
