"""Point-to-point transfers between pipeline ranks.

``post`` puts a step's sends and the receives the plan (megalite.pipeline.transfers) calls for into one
``batch_isend_irecv``: on NCCL a send can wait for its receiver, so a send and a receive with the same neighbour
must be in flight together (Megatron's send_forward_recv_backward pairs) or two ranks could each wait on the other.
Nothing is waited for there: ``take`` waits for one received message when its step needs it, so receives posted
ahead run during compute. NCCL coalesces a batch into one Work for all its operations (gloo returns one per
operation): there each receive and send completes with its whole batch. Shapes are known from the config
(micro-batch x sequence x hidden), so nothing but the tensors crosses the link.

A sent activation can be freed once its send has completed (``free_when_sent``): the next stage has it, and this
stage needs only its autograd graph for the backward, not its values (Megatron's deallocate_output_tensor). The
storage is resized to nothing, so the tensor keeps its shape and grad_fn and ``torch.autograd.backward(output,
grad)`` still runs; nothing in the graph may read it, which holds for a stage's output (a residual sum, which no
backward saves). ``freed_bytes`` counts what that released.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel_state import GroupInfo
from megalite.pipeline.schedules import Message


def free_storage(tensor: torch.Tensor) -> int:
    """Release ``tensor``'s data, keeping its shape and autograd graph; the bytes released."""
    storage = tensor.untyped_storage()
    size = storage.nbytes()
    storage.resize_(0)
    return size


class _Batch:
    """The Works of one batch as one, done when all of them are. Its ops wait for it each, but each Work is waited
    for once (gloo's send Work waits for one more completion at each wait)."""

    def __init__(self, works: list[dist.Work]):
        self.works = list(works)

    def wait(self) -> bool:
        while self.works:
            self.works[0].wait()
            self.works.pop(0)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _works_per_op(works: list[dist.Work], num_ops: int) -> list:
    """One Work per op of a ``batch_isend_irecv`` of ``num_ops`` ops: gloo returns one per op; NCCL coalesces the
    batch and returns one for all of them, so there each op completes with the whole batch."""
    return works if len(works) == num_ops else [_Batch(works)] * num_ops


class PipelineLinks:
    def __init__(self, group: GroupInfo, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.group, self.shape, self.dtype, self.device = group, shape, dtype, device
        # Sends in flight: (round posted, work, the buffer sent, the tensor to free once it completes or None).
        self._sending: list[tuple[int, dist.Work, torch.Tensor, torch.Tensor | None]] = []
        self._receiving: dict[Message, tuple[dist.Work, torch.Tensor]] = {}
        self.freed_bytes = 0

    def post(self, sends: list[tuple[int, torch.Tensor, bool]], receives: list[tuple[int, Message]],
             round_index: int = 0) -> None:
        """Start sending each (pipeline rank, tensor, free_when_sent) and receiving each (pipeline rank, message),
        as round ``round_index`` of the transfer plan (megalite.pipeline.transfers)."""
        ops, freeing = [], []
        for peer, tensor, free_when_sent in sends:
            buffer = tensor.detach().to(self.dtype).contiguous()
            if free_when_sent and buffer.untyped_storage()._cdata != tensor.untyped_storage()._cdata:   # a copy
                self.freed_bytes += free_storage(tensor)   # sent from a copy: the original can go now
                free_when_sent = False
            ops.append(dist.P2POp(dist.isend, buffer, self.group.ranks[peer], group=self.group.group))
            freeing.append(tensor if free_when_sent else None)
        buffers = []
        for peer, message in receives:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buffer, self.group.ranks[peer], group=self.group.group))
            buffers.append((message, buffer))
        if not ops:
            return
        works = _works_per_op(dist.batch_isend_irecv(ops), len(ops))
        for work, op, tensor in zip(works, ops, freeing):
            self._sending.append((round_index, work, op.tensor, tensor))
        for work, (message, buffer) in zip(works[len(sends):], buffers):
            self._receiving[message] = (work, buffer)

    def take(self, message: Message) -> torch.Tensor:
        """Wait for ``message`` (posted earlier) and hand it over."""
        if message not in self._receiving:
            raise RuntimeError(f"no receive posted for {message}: the transfer plan and the schedule disagree")
        work, buffer = self._receiving.pop(message)
        work.wait()
        self.reap_sends()
        return buffer

    def reap_sends(self, wait_before_round: int = 0) -> None:
        """Forget completed sends, freeing what was to be freed once sent; first wait for those posted before
        round ``wait_before_round`` (gloo reports a send completed only once waited for; NCCL's complete on their
        own)."""
        still = []
        for entry in self._sending:
            round_index, work, _, tensor = entry
            if round_index < wait_before_round:
                work.wait()
            elif not work.is_completed():
                still.append(entry)
                continue
            if tensor is not None:
                self.freed_bytes += free_storage(tensor)
        self._sending = still

    def finish(self) -> None:
        """Wait for every send still in flight (their buffers must outlive the transfer)."""
        for _, work, _, _ in self._sending:
            work.wait()
        self.reap_sends()
        if self._receiving:
            raise RuntimeError(f"receives posted but never taken: {sorted(map(str, self._receiving))}")
