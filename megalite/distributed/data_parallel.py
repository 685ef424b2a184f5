"""The data-parallel engine: gradients in contiguous fp32 buckets, reduced over DP ranks, optionally overlapped.

Each parameter's gradient is accumulated (in fp32, whatever the parameter dtype; in bf16 with
``--grad-reduce-in-bf16``, half the memory and traffic) into its slice of a flat buffer by a hook that runs as soon
as autograd has produced it. With gradient-accumulation fusion (the default; not under ZeRO-2, which has no such
buffer) the column- and row-parallel linears' weights skip autograd's gradient and the hook: the linear's backward
adds dA into the slice by one matmul and reports it (megalite.tensor_parallel.weight_grad). A bucket whose
parameters all have their gradient for the *last* micro-batch of the global batch is ready; with
``overlap_grad_reduce`` its reduction starts there and then, asynchronously, while backward goes on with the other
buckets; otherwise all buckets are reduced at the end. No reduction ever happens for the earlier micro-batches.

The reduction depends on the optimizer:
- plain data parallel: all-reduce each bucket (every rank gets the whole summed gradient);
- distributed optimizer, ZeRO-1: reduce-scatter each bucket; a rank keeps the summed gradient of its own shard;
- ZeRO-2: there is no persistent full-size gradient buffer. Gradients wait in ``param.grad`` until their bucket
  is ready *in each micro-batch*; then they are packed into a scratch buffer, reduce-scattered, added to this rank's
  shard accumulator and freed. Memory for gradients is 1/DP plus what backward holds in flight.

HSDP (``--num-distributed-optimizer-instances N``): ``data_group`` is then one instance's DP x CP / N ranks, over
which the distributed optimizer shards, and ``replica_group`` the N ranks holding the same shard in each instance.
Megatron's two-level reduction: each bucket is reduce-scattered inside the instance, then its shard is all-reduced
across the replicas (on NCCL both on a side stream, the all-reduce after the reduce-scatter, so backward's stream
waits only at the end). Under ZeRO-2, whose reduce-scatter runs every micro-batch, the accumulated shards are
all-reduced across the replicas once per step instead. Parameters are gathered inside the instance only: every
instance steps the same shards alike.

Sums, not means: the loss is already normalized by the global token count. After the optimizer step, the
distributed optimizer writes updated shards into the flat parameter buffer and ``gather_params`` all-gathers each
bucket (asynchronously with ``overlap_param_gather``: a forward pre-hook waits for a module's buckets just before
the module runs). Gathers are launched in the order forward first needed the buckets (recorded by those hooks), so
the first layer's parameters arrive first and each wait is on the oldest gather in flight; reductions go in the
order backward finished the buckets (as each finishes with ``overlap_grad_reduce``, else at the end in that order).

Tied word embeddings split across pipeline stages are "deferred": their bucket waits until the end, where their
gradient is first summed with the other copy's (megalite.distributed.finalize, which also sums the
sequence-parallel parameters' gradients over TP once the DP reductions are done), then reduced over DP like the
rest. Under the distributed optimizer the FP8 linears' weights have buckets of their own, which
``fp8_param_gather`` gathers as FP8 bytes (megalite.distributed.fp8_param_gather).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megalite.distributed.buckets import Bucket, plan_buckets
from megalite.distributed.engine import DataParallelEngine, Piece
from megalite.distributed.finalize import finalize_model_grads
from megalite.distributed.fp8_param_gather import Fp8ParamGather, fp8_linears
from megalite.parallel_state import GroupInfo
from megalite.tensor_parallel.fp8_linear import weights_updated
from megalite.tensor_parallel.weight_grad import MAIN_GRAD_ACCUMULATOR


def default_bucket_size(dp: int) -> int:
    """Elements per bucket unless --ddp-bucket-size says otherwise (Megatron's rule): 40M, or 1M per DP rank when
    that is more, so each rank's shard of a bucket stays at least 1M elements. The planner sizes buckets with it."""
    return max(40_000_000, 1_000_000 * dp)


# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch (2.11 on the GPU machines) has
# only the old ones. Same signatures.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _fusable_weights(modules: list[torch.nn.Module], params: list[torch.nn.Parameter],
                     tied: list[torch.nn.Parameter]) -> set[int]:
    """ids of the weights whose gradient a linear layer can add into the buffer itself: those that the column- and
    row-parallel linears own (the layers with a ``weight_grad_store``, which compute their weight gradient through
    megalite.tensor_parallel.weight_grad) and that nothing else uses (not a tied embedding, not shared). An FP8
    linear (``fp8`` set) hands its weight gradient to autograd instead: its weight keeps the hook."""
    owned = [sub.weight for m in modules for sub in m.modules()
             if hasattr(sub, "weight_grad_store") and isinstance(getattr(sub, "weight", None), torch.nn.Parameter)
             and getattr(sub, "fp8", None) is None]
    uses = Counter(id(w) for w in owned)
    trained, excluded = {id(p) for p in params}, {id(p) for p in tied}
    return {id(w) for w in owned if uses[id(w)] == 1 and id(w) in trained and id(w) not in excluded}


class DataParallel(DataParallelEngine):
    def __init__(self, modules: list[torch.nn.Module], *, data_group: GroupInfo,
                 embedding_group: Optional[GroupInfo] = None, tied_params: list[torch.nn.Parameter] = (),
                 bucket_size: Optional[int] = None, zero: int = 0,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                 tensor_group: Optional[GroupInfo] = None, grad_dtype: torch.dtype = torch.float32,
                 select: Callable[[torch.nn.Parameter], bool] = lambda param: True,
                 gradient_accumulation_fusion: bool = False, fp8_param_gather: bool = False,
                 replica_group: Optional[GroupInfo] = None):
        """``select``: which of the modules' trainable parameters this engine owns (all by default; with expert
        parallelism one engine takes the dense parameters and another the experts', see expert_parallel).
        ``fp8_param_gather``: the distributed optimizer gathers the FP8 linears' weights in FP8.
        ``replica_group`` (HSDP, the distributed optimizer only): the ranks holding this rank's shard in the other
        instances, over which the shards reduced over ``data_group`` are summed."""
        self.group = data_group
        self.replica_group = replica_group if replica_group is not None and replica_group.size > 1 else None
        if self.replica_group is not None and zero not in (1, 2):
            raise ValueError("replicas of the shards (HSDP) need the distributed optimizer (ZeRO-1 or 2)")
        self.grad_dtype = grad_dtype
        self.embedding_group = embedding_group
        self.tensor_group = tensor_group
        self.dp, self.dp_rank = data_group.size, data_group.rank
        self.distributed = zero in (1, 2)   # OptimizerConfig.zero_level: the distributed optimizer's stages
        self.zero2 = zero == 2
        self.overlap_grad_reduce, self.overlap_param_gather = overlap_grad_reduce, overlap_param_gather
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad and select(p)]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"all parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.param_dtype = dtypes.pop()
        self.device = device = self.params[0].device
        # HSDP on a GPU: each overlapped bucket's reduce-scatter and then all-reduce run in order on this stream.
        self._side_stream = (torch.cuda.Stream(device) if self.replica_group is not None and device.type == "cuda"
                             else None)
        size = bucket_size or default_bucket_size(self.dp)
        # The FP8 linears' weights get buckets of their own under the distributed optimizer, with or without
        # fp8_param_gather: the same layout sums gradients in the same order, so the option changes the gather only.
        linears = (fp8_linears(modules, [p for p in self.params if id(p) not in {id(t) for t in tied_params}])
                   if self.distributed and self.dp > 1 else [])
        # Each MoE layer's experts' weights of a kind stay together, stacked: the grouped product reads them as one.
        together = [group for m in modules for sub in m.modules() if hasattr(sub, "stacked_parameters")
                    for group in sub.stacked_parameters()]
        self.plan = plan_buckets(self.params, size, self.dp, tied_params, [linear.weight for linear in linears],
                                 together)
        self.buckets = self.plan.buckets
        self.tied_params = list(tied_params)

        # Parameters become views into one flat buffer, so the distributed optimizer can all-gather bucket by bucket.
        self.param_buffer = torch.zeros(self.plan.total, dtype=self.param_dtype, device=device)
        for p in self.params:
            start, end = self.range(p)
            self.param_buffer[start:end].copy_(p.data.view(-1))
            p.data = self.param_buffer[start:end].view_as(p)

        self.fp8 = Fp8ParamGather(self, linears) if fp8_param_gather and linears else None
        self._stale: set[int] = set()   # FP8 buckets whose bf16 copies are not gathered since their last update

        if self.zero2:
            self.grad_shards = [torch.zeros(b.shard(0, self.dp)[1] - b.start, dtype=grad_dtype, device=device)
                                for b in self.buckets]
        else:
            self.grad_buffer = torch.zeros(self.plan.total, dtype=grad_dtype, device=device)
            for p in self.params:
                start, end = self.range(p)
                p.main_grad = self.grad_buffer[start:end].view_as(p)

        # Parameters with no gradient yet this step (see zero_grad); ZeRO-2 has no full-size buffer to overwrite.
        self._fresh: set[int] = set() if self.zero2 else {id(p) for p in self.params}
        # Gradient-accumulation fusion: the linears' own weights get their gradient added into the buffer by the
        # linear's backward, which then reports it here (_accumulate_weight_gradient); they need no hook.
        self.fused = (_fusable_weights(modules, self.params, self.tied_params)
                      if gradient_accumulation_fusion and not self.zero2 else set())
        for p in self.params:
            if id(p) in self.fused:
                setattr(p, MAIN_GRAD_ACCUMULATOR, functools.partial(self._accumulate_weight_gradient, p))
            elif hasattr(p, MAIN_GRAD_ACCUMULATOR):   # an earlier engine's
                delattr(p, MAIN_GRAD_ACCUMULATOR)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params
                       if id(p) not in self.fused]
        self._pending_reductions: list[tuple[Optional[dist.Work], Callable[[], None]]] = []
        # bucket index -> (gather work, its input buffer, kept alive until the gather completes)
        self._pending_gathers: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        # Buckets in the order forward first needed them (recorded by the pre-hooks, the same on every DP rank, as
        # they run the same model): the order their gathers are launched in.
        self._forward_order: list[int] = []
        # Buckets in the order backward finished them in the last micro-batch: the order their reductions go in.
        self._backward_order: list[int] = []
        if overlap_param_gather:
            for m in modules:
                for sub in m.modules():
                    # An MoE layer's experts' parameters are read by the experts' forward, not by their own modules'.
                    used = ([p for group in sub.stacked_parameters() for p in group]
                            if hasattr(sub, "stacked_parameters") else list(sub.parameters(recurse=False)))
                    if any(select(p) for p in used):
                        self._hooks.append(sub.register_forward_pre_hook(
                            functools.partial(self._wait_for_params, used)))
        self.start_iteration(1)

    # ---- where parameters live ----------------------------------------------------------------------------------
    def range(self, param: torch.nn.Parameter) -> tuple[int, int]:
        return self.plan.ranges[id(param)]

    def bucket_of(self, param: torch.nn.Parameter) -> Bucket:
        return self.buckets[self.plan.bucket_of[id(param)]]

    def shard(self, bucket: Bucket) -> tuple[int, int]:
        return bucket.shard(self.dp_rank, self.dp)

    def local_slice(self, param: torch.nn.Parameter) -> Optional[tuple[int, int]]:
        """The flat range of ``param`` in this rank's shard of its bucket (None where it has none there)."""
        start, end = self.range(param)
        shard_start, shard_end = self.shard(self.bucket_of(param))
        start, end = max(start, shard_start), min(end, shard_end)
        return (start, end) if start < end else None

    def reduced_grad(self, bucket: Bucket, start: int, end: int) -> torch.Tensor:
        """The summed gradient of flat range [start, end), which must lie in this rank's shard when sharded."""
        if self.zero2:
            shard_start = self.shard(bucket)[0]
            return self.grad_shards[bucket.index][start - shard_start: end - shard_start]
        return self.grad_buffer[start:end]

    def pieces(self) -> list[Piece]:
        """Every parameter whole, or with the distributed optimizer its intersection with this rank's bucket shards
        (parameters lying wholly in other ranks' shards give no piece)."""
        result = []
        for param in self.params:
            start, end = self.range(param)
            bucket = self.bucket_of(param)
            if self.distributed:
                if (piece := self.local_slice(param)) is None:
                    continue
                start, end = piece
            result.append(Piece(param, start, end, self.param_buffer[start:end], self.reduced_grad(bucket, start, end)))
        return result

    def held_bytes(self) -> tuple[int, int]:
        grads = self.grad_shards if self.zero2 else [self.grad_buffer]
        fp8_copies = self.fp8.held_bytes() if self.fp8 is not None else 0
        return (self.param_buffer.numel() * self.param_buffer.element_size() + fp8_copies,
                sum(g.numel() * g.element_size() for g in grads))

    # ---- gradient reduction ---------------------------------------------------------------------------------------
    def start_iteration(self, num_micro_batches: int) -> None:
        """Reset readiness counting for a global batch of ``num_micro_batches`` backward passes."""
        self.num_micro_batches = num_micro_batches
        self._waiting = {b.index: len(b.params) for b in self.buckets}
        self._micro_batches_done = {b.index: 0 for b in self.buckets}
        self._launched: set[int] = set()
        self._backward_order = []

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if param.grad is None:   # a zero-bubble B step left this weight's gradient to its W step, which brings it
            return
        if not self.zero2:
            if id(param) in self._fresh:   # the step's first gradient: write it, no zeroed buffer to add to
                param.main_grad.copy_(param.grad)
                self._fresh.discard(id(param))
            else:
                param.main_grad.add_(param.grad)
            param.grad = None
        self._count_ready(param)

    @torch.no_grad()   # also when a zero-bubble W step runs it, outside backward
    def _accumulate_weight_gradient(self, param: torch.nn.Parameter, grad_output: torch.Tensor,
                                    total_input: torch.Tensor) -> None:
        """A fused linear's dA = grad_output^T total_input ([tokens, out] and [tokens, in]), written (the step's
        first) or added into the parameter's main gradient by one matmul; then counted for its bucket."""
        target, first = param.main_grad, id(param) in self._fresh
        if grad_output.dtype == target.dtype:
            if first:
                torch.mm(grad_output.t(), total_input, out=target)
            else:
                target.addmm_(grad_output.t(), total_input)
        else:   # bf16 activations into an fp32 buffer: the product in their dtype, then added, as unfused
            product = grad_output.t().matmul(total_input)
            target.copy_(product) if first else target.add_(product)
        self._fresh.discard(id(param))
        self._count_ready(param)

    def _count_ready(self, param: torch.nn.Parameter) -> None:
        """One more parameter of its bucket has this micro-batch's gradient; a full bucket is reduced (now if
        overlapped and the last micro-batch's, or every micro-batch under ZeRO-2)."""
        bucket = self.bucket_of(param)
        self._waiting[bucket.index] -= 1
        if self._waiting[bucket.index] > 0:
            return
        self._waiting[bucket.index] = len(bucket.params)
        self._micro_batches_done[bucket.index] += 1
        if bucket.deferred:
            return
        last = self._micro_batches_done[bucket.index] == self.num_micro_batches
        if last:
            self._backward_order.append(bucket.index)
        if self.zero2:
            self._launch(bucket, async_op=self.overlap_grad_reduce)   # every micro-batch: frees the gradients
        elif last and self.overlap_grad_reduce:
            self._launch(bucket, async_op=True)

    def _launch(self, bucket: Bucket, async_op: bool) -> None:
        if self.zero2:
            scratch = torch.zeros(bucket.end - bucket.start, dtype=self.grad_dtype, device=self.param_buffer.device)
            for p in bucket.params:
                if p.grad is not None:
                    start, end = self.range(p)
                    scratch[start - bucket.start: end - bucket.start].copy_(p.grad.view(-1))
                    p.grad = None
            full = scratch
        else:
            self._launched.add(bucket.index)
            self._zero_fresh(bucket.params)
            full = self.grad_buffer[bucket.start:bucket.end]
        if not self.distributed:
            work = dist.all_reduce(full, group=self.group.group, async_op=async_op) if self.dp > 1 else None
            self._pending_reductions.append((work, lambda: None))
            return
        start, end = self.shard(bucket)
        shard_sum = (torch.empty(end - start, dtype=self.grad_dtype, device=full.device) if self.dp > 1
                     else full)   # an instance of one rank: its shard is the bucket
        work = self._reduce(shard_sum, full, async_op)
        if self.zero2:
            accumulator = self.grad_shards[bucket.index]
            complete = lambda: accumulator.add_(shard_sum)   # noqa: E731
        else:
            target = self.grad_buffer[start:end]
            complete = lambda: target.copy_(shard_sum) if self.dp > 1 else None   # noqa: E731
        if async_op:
            self._pending_reductions.append((work, complete))
        else:   # done: its scratch shard freed now, not held with every other bucket's until the last is reduced
            complete()

    def _reduce(self, shard_sum: torch.Tensor, full: torch.Tensor, async_op: bool) -> Optional[dist.Work]:
        """Sum ``full`` over the data group into this rank's ``shard_sum`` (reduce-scatter), then over the replicas
        (HSDP, not under ZeRO-2: see the module docstring); the last collective's Work (None: nothing launched)."""
        across = self.replica_group is not None and not self.zero2
        side = self._side_stream if across and async_op else None
        if side is not None:   # the gradients it reduces were written on the compute stream
            side.wait_stream(torch.cuda.current_stream(self.device))
        work = None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if self.dp > 1:   # before the all-reduce reads its result (on NCCL a stream wait, not a host one)
                work = _reduce_scatter(shard_sum, full, group=self.group.group, async_op=async_op and not across)
            if across:
                work = dist.all_reduce(shard_sum, group=self.replica_group.group, async_op=async_op)
        return work

    def finish_grad_sync(self) -> None:
        finalize_model_grads(self)   # the tied copies summed, reduce_data_parallel, the sequence-parallel sums

    def tied_gradients(self) -> list[torch.Tensor]:
        """The tied copies' whole gradients, their deferred bucket not yet reduced: in the buffer (zeroed where a
        copy got none this step), or under ZeRO-2 in ``.grad`` (zeros where none came)."""
        self._zero_fresh(self.tied_params)
        if self.zero2:
            for p in self.tied_params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        return [(p.grad if self.zero2 else p.main_grad).view(-1) for p in self.tied_params]

    def reduce_data_parallel(self) -> None:
        """Reduce every bucket not yet reduced, in the order backward finished them, then those it never finished
        (the deferred ones); wait for all."""
        finished = set(self._backward_order)
        for bucket in [self.buckets[i] for i in self._backward_order] + [b for b in self.buckets
                                                                         if b.index not in finished]:
            if self.zero2:
                if bucket.deferred or any(p.grad is not None for p in bucket.params):
                    self._launch(bucket, async_op=False)   # deferred, or a parameter that got no gradient hook
            elif bucket.index not in self._launched:
                self._launch(bucket, async_op=False)
        for work, complete in self._pending_reductions:
            if work is not None:
                work.wait()
            complete()
        self._pending_reductions.clear()
        if self.zero2 and self.replica_group is not None:   # the step's accumulated shards, over the replicas
            for shard in self.grad_shards:
                self.replica_group.sum(shard)

    def _zero_fresh(self, params) -> None:
        """Zero the summed gradient of parameters that got none this step (it still holds the last step's)."""
        for p in params:
            if id(p) in self._fresh:
                p.main_grad.zero_()
                self._fresh.discard(id(p))

    def zero_grad(self) -> None:
        """Start a new step's gradients. The full-size buffer is not zeroed: each parameter's first gradient of the
        step overwrites its slice (a pass over the buffer saved), and a slice that gets none is zeroed before its
        reduction; bucket padding is never written and stays zero."""
        if self.zero2:
            for shard in self.grad_shards:
                shard.zero_()
        else:
            self._fresh = {id(p) for p in self.params}
        for p in self.params:
            p.grad = None

    # ---- parameter gather (distributed optimizer) -----------------------------------------------------------------
    def gather_params(self) -> None:
        """All-gather every bucket's updated shards into the full parameters (an FP8 bucket's as FP8 bytes into
        its FP8 buffer)."""
        weights_updated()   # the optimizer wrote the parameters through the flat buffer: cached FP8 copies are stale
        if not self.distributed or self.dp == 1:
            return
        if self.fp8 is not None:
            self.fp8.prepare(self)
        for bucket in self.gather_order():
            if self.fp8 is not None and bucket.index in self.fp8.buffers:
                local, full = self.fp8.shard_bytes(self, bucket), self.fp8.buffers[bucket.index]
                self._stale.add(bucket.index)
            else:
                start, end = self.shard(bucket)
                local = self.param_buffer[start:end].clone()   # gloo does not promise in-place gathers
                full = self.param_buffer[bucket.start:bucket.end]
            work = _all_gather(full, local, group=self.group.group, async_op=self.overlap_param_gather)
            if self.overlap_param_gather:
                self._pending_gathers[bucket.index] = (work, local)
        # Without overlap the gathers completed above.
        if self.fp8 is not None:
            self.fp8.stamp()

    def gather_order(self) -> list[Bucket]:
        """The buckets in the order forward needs them: as its pre-hooks first asked for them, then any it never
        asked for, from the first parameters defined (the layout is reversed: the last bucket holds them)."""
        seen = set(self._forward_order)
        return [self.buckets[i] for i in self._forward_order] + [b for b in reversed(self.buckets)
                                                                 if b.index not in seen]

    def _wait_for_params(self, params: list[torch.nn.Parameter], _module: torch.nn.Module, _inputs) -> None:
        for p in params:
            index = self.plan.bucket_of.get(id(p), -1)
            if index >= 0 and index not in self._forward_order:
                self._forward_order.append(index)
            pending = self._pending_gathers.pop(index, None)
            if pending is not None:
                pending[0].wait()

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter gather (before evaluation, checkpointing or the end); bring the
        FP8 buckets' bf16 copies up to date (their bf16 gather, skipped while training)."""
        for work, _ in self._pending_gathers.values():
            work.wait()
        self._pending_gathers.clear()
        for index in sorted(self._stale):
            bucket = self.buckets[index]
            start, end = self.shard(bucket)
            _all_gather(self.param_buffer[bucket.start:bucket.end], self.param_buffer[start:end].clone(),
                        group=self.group.group)
        if self._stale:
            self._stale.clear()
            self.fp8.stamp()   # the weights are what the FP8 copies were made of
