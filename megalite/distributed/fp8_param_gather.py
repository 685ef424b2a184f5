"""--fp8-param-gather: the distributed optimizer all-gathers the FP8 linears' weights as FP8 bytes.

After the optimizer step each data-parallel rank holds the updated values of its shard of every bucket and
all-gathers them, 2 bytes an element in bf16. With this option the weights of the FP8 linears, which sit in buckets
of their own (megalite.distributed.buckets), are quantized where they were updated, shard by shard, and their bytes
all-gathered instead (as uint8, which every backend carries: gloo refuses FP8 types), 1 byte an element, into a
buffer the linears multiply by directly (megalite.tensor_parallel.fp8_linear.GatheredFp8Weight): half the traffic of
those buckets, and no quantization of the weights in forward.

The bytes are those the forward would have made of the whole weight, because the scale is the whole weight's:
- tensorwise (and the delayed recipe before its first history entry): fp8_max / amax, the amax maxed over the DP
  shards and then over TP (every FP8 weight is split over TP), one small all-reduce each for all weights together;
- delayed: the scale from the history, the same on every rank (no collective); the shard's amax is recorded as the
  step's weight amax, which update_delayed_scales maxes over DP and TP like every other amax.
So a run with the option takes the same steps, bit for bit, as one without; the trainer updates the delayed scales
before the optimizer step, so that the gather already quantizes with the scales of the step that follows.

What is not gathered goes stale: the bf16 weights outside this rank's shards. Nothing reads them while training (the
linears read their FP8 copies); the engine gathers them in bf16 only when whole weights are needed (evaluation,
checkpoints, the end of training: ``finish_param_sync``). The bf16 copies stay allocated: this option saves
traffic, not memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megalite import parallel_state
from megalite.tensor_parallel.fp8 import E4M3, amax, quantize
from megalite.tensor_parallel.fp8_linear import GATHERED, GatheredFp8Weight, gathered_weight_scales

if TYPE_CHECKING:
    from megalite.distributed.buckets import Bucket
    from megalite.distributed.data_parallel import DataParallel


def fp8_linears(modules: list[torch.nn.Module], params: list[torch.nn.Parameter]) -> list[torch.nn.Module]:
    """The FP8 linears (``fp8`` set) whose weight is one of ``params``, each once, in definition order."""
    wanted, found, seen = {id(p) for p in params}, [], set()
    for m in modules:
        for sub in m.modules():
            weight = getattr(sub, "weight", None)
            if (getattr(sub, "fp8", None) is not None and isinstance(weight, torch.nn.Parameter)
                    and id(weight) in wanted and id(weight) not in seen):
                seen.add(id(weight))
                found.append(sub)
    return found


class Fp8ParamGather:
    """The FP8 side of one engine's parameter gather: a byte buffer per FP8 bucket, the weights' views into it."""

    def __init__(self, engine: DataParallel, linears: list[torch.nn.Module]):
        self.linears = linears
        buckets = sorted({engine.plan.bucket_of[id(linear.weight)] for linear in linears})
        self.buffers = {i: torch.zeros(engine.buckets[i].end - engine.buckets[i].start, dtype=torch.uint8,
                                       device=engine.device) for i in buckets}
        self.values = []
        for linear in linears:
            bucket = engine.bucket_of(linear.weight)
            start, end = engine.range(linear.weight)
            flat = self.buffers[bucket.index][start - bucket.start: end - bucket.start]
            self.values.append(flat.view(E4M3).view(linear.weight.shape))
        self.scales: dict[int, torch.Tensor] = {}   # id(weight) -> this gather's scale

    @torch.no_grad()
    def prepare(self, engine: DataParallel) -> None:
        """This gather's scale of every FP8 weight (see the module docstring), hung on the weights with their
        views; their bytes arrive with the bucket gathers that follow."""
        amaxes = torch.zeros(len(self.linears), device=engine.device)
        for i, linear in enumerate(self.linears):
            piece = engine.local_slice(linear.weight)
            if piece is not None:
                amaxes[i] = amax(engine.param_buffer[piece[0]:piece[1]])
        groups = (engine.group, parallel_state.get_tensor_model_parallel_group())
        scales = gathered_weight_scales(self.linears, amaxes, groups)
        for linear, value, scale in zip(self.linears, self.values, scales):
            self.scales[id(linear.weight)] = scale
            setattr(linear.weight, GATHERED, GatheredFp8Weight(value, scale.reciprocal(), version=-1))

    @torch.no_grad()
    def shard_bytes(self, engine: DataParallel, bucket: Bucket) -> torch.Tensor:
        """This rank's shard of an FP8 bucket, quantized by :meth:`prepare`'s scales, as bytes (padding zero)."""
        start, end = engine.shard(bucket)
        out = torch.zeros(end - start, dtype=torch.uint8, device=engine.device)
        for param in bucket.params:
            first, last = engine.range(param)
            first, last = max(first, start), min(last, end)
            if first < last:
                out[first - start: last - start] = quantize(engine.param_buffer[first:last], self.scales[id(param)],
                                                            E4M3).view(torch.uint8)
        return out

    def stamp(self) -> None:
        """Mark the FP8 copies current for the weights as they are now (after the engine last wrote its buffer)."""
        for linear in self.linears:
            gathered = getattr(linear.weight, GATHERED, None)
            if gathered is not None:
                gathered.version = linear.weight._version

    def held_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self.buffers.values())

