"""Point-to-point transfers between neighbouring pipeline ranks.

Each exchange posts this step's receive together with the previous step's send in one ``batch_isend_irecv``: on
NCCL a send can wait for its receiver, so a send and a receive with the same neighbour must be in flight together
(Megatron's send_forward_recv_backward pairs) or two ranks could each wait on the other. Shapes are known from the
config (micro-batch x sequence x hidden), so nothing but the tensors crosses the link.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel_state import GroupInfo


class PipelineLinks:
    def __init__(self, group: GroupInfo, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.group, self.shape, self.dtype, self.device = group, shape, dtype, device
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []   # sends, kept alive until completed

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recv_from: list[int]) -> list[torch.Tensor]:
        """Send ``(pipeline rank, tensor)`` pairs and receive one tensor from each listed pipeline rank."""
        ops, received = [], []
        for peer, tensor in sends:
            tensor = tensor.detach().to(self.dtype).contiguous()
            ops.append(dist.P2POp(dist.isend, tensor, self.group.ranks[peer], group=self.group.group))
        for peer in recv_from:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buffer, self.group.ranks[peer], group=self.group.group))
            received.append(buffer)
        if not ops:
            return received
        works = dist.batch_isend_irecv(ops)
        # Drop sends that have completed, keep the rest (and their buffers) alive.
        self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]
        for work, op in zip(works[: len(sends)], ops[: len(sends)]):
            self._in_flight.append((work, op.tensor))
        for work in works[len(sends):]:
            work.wait()
        return received

    def finish(self) -> None:
        """Wait for every send still in flight (their buffers must outlive the transfer)."""
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight.clear()
