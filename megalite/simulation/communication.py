"""Count what a step hands to torch.distributed: elements and bytes per collective / point-to-point call, by process
group kind (tensor, tensor_share, context, pipeline, data, data_context, embedding, model, expert, expert_data,
intra_instance, inter_instance, world), without touching the code that calls it. The simulated GPUs (megalite.simulation) count with it and, through
``nccl_device``, also hold every call to NCCL's rules; the benchmarks and tests count real runs with it.

``with count_communication() as counter: step()`` swaps the torch.distributed functions (and the aliases megalite
modules took of them at import time, e.g. ``megalite.distributed.data_parallel._reduce_scatter``, which torch 2.13's
renames made ``reduce_scatter_single`` or ``reduce_scatter_tensor`` depending on the version) for counting wrappers,
and puts the originals back on exit. Only the outermost call counts (torch 2.13's deprecated names call the new
ones). ``batch_isend_irecv`` runs each ``P2POp``'s own function, which is the counting isend/irecv while the
counter is active (the P2POp must be built inside the block; ours and torch's pipelining build them per step).

Conventions, so that numbers compare with the textbook formulas:
- all-reduce, broadcast: the tensor's elements;
- reduce-scatter: the elements of the full (input) tensor; all-gather: the elements of the full (output) tensor,
  so a reduce-scatter + all-gather pair moves as many elements as 2 all-reduces are counted;
- send/isend: the tensor's elements; receives are counted separately ("recv") and are the same bytes seen from the
  other end, so a p2p total uses sends only;
- all-to-all (``all_to_all_single``): the elements this rank sends, its part for itself included ((n-1)/n of them
  leave the rank when the parts are equal).
Each rank counts its own calls; totals are sums over ranks.

``count_communication(nccl_device=device)`` adds two rules NCCL keeps and gloo does not: every tensor handed to a
collective or a send/receive must be on ``device`` (else :class:`CommunicationContractError` names the caller's file
and line), and ``batch_isend_irecv`` returns ONE Work for the whole batch, as NCCL's coalesced batches do.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import traceback
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_COLLECTIVES = {   # name -> (the counted tensor's parameter name, its position)
    "all_reduce": ("tensor", 0),
    "broadcast": ("tensor", 0),
    "reduce_scatter_tensor": ("input", 1),
    "reduce_scatter_single": ("input", 1),
    "all_gather_into_tensor": ("output_tensor", 0),
    "all_gather_single": ("output_tensor", 0),
    "all_gather": ("tensor_list", 0),
    "reduce_scatter": ("input_list", 1),
    "all_to_all_single": ("input", 1),
    "isend": ("tensor", 0),
    "irecv": ("tensor", 0),
    "send": ("tensor", 0),
    "recv": ("tensor", 0),
}
_KIND_OF_OP = {"isend": "send", "send": "send", "irecv": "recv", "recv": "recv",
               "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
               "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather"}


def _group_kinds() -> dict[int, str]:
    """id(torch group) -> kind, from megalite's registered layout (when there is one)."""
    from megalite import parallel_state
    kinds: dict[int, str] = {}
    if not parallel_state.is_initialized():
        return kinds
    state = parallel_state.state()
    # Later kinds do not overwrite earlier ones: with DP=1 the model group may equal another; name it once.
    for kind in ("tensor", "context", "pipeline", "data", "data_context", "embedding", "model", "expert",
                 "expert_data", "intra_instance", "inter_instance"):   # (HSDP's two levels, named when N > 1)
        info = getattr(state, kind)
        if info is not None and info.group is not None:
            kinds.setdefault(id(info.group), kind)
    for info in state.tensor_shares.values():   # the TP/G ranks sharing a key/value head
        if info.group is not None:
            kinds.setdefault(id(info.group), "tensor_share")
    for inner, outer in state.context_shares.values():   # --cp-comm-type a2a+p2p's two levels
        for info, kind in ((inner, "context_a2a"), (outer, "context_ring")):
            if info.group is not None:
                kinds.setdefault(id(info.group), kind)
    return kinds


class CommCounter:
    def __init__(self):
        # (op, group kind) -> [calls, elements, bytes]
        self.totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        # (op, group kind, elements per call) -> calls: to tell the b*s*h all-reduces from the small ones
        self.by_size: dict[tuple[str, str, int], int] = defaultdict(int)
        self._kinds = _group_kinds()

    def record(self, op: str, group, tensor) -> None:
        tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
        elements = sum(t.numel() for t in tensors)
        size = sum(t.numel() * t.element_size() for t in tensors)
        if group is not None and group is not c10d.GroupMember.WORLD and id(group) not in self._kinds:
            self._kinds = _group_kinds()   # the layout's groups were built after the counter started
        kind = "world" if group is None or group is c10d.GroupMember.WORLD else self._kinds.get(id(group), "other")
        op = _KIND_OF_OP.get(op, op)
        entry = self.totals[(op, kind)]
        entry[0] += 1
        entry[1] += elements
        entry[2] += size
        self.by_size[(op, kind, elements)] += 1

    def elements(self, op: str | None = None, kind: str | None = None, size: int | None = None) -> int:
        """Elements counted, filtered by op (all_reduce, reduce_scatter, all_gather, send, ...), group kind and,
        optionally, elements per call."""
        if size is not None:
            return sum(n * s for (o, k, s), n in self.by_size.items()
                       if (op is None or o == op) and (kind is None or k == kind) and s == size)
        return sum(v[1] for (o, k), v in self.totals.items()
                   if (op is None or o == op) and (kind is None or k == kind))

    def bytes(self, op: str | None = None, kind: str | None = None) -> int:
        """Bytes counted, filtered by op and group kind."""
        return sum(v[2] for (o, k), v in self.totals.items()
                   if (op is None or o == op) and (kind is None or k == kind))

    def as_dict(self) -> dict:
        return {"totals": {f"{o}|{k}": v for (o, k), v in self.totals.items()},
                "by_size": {f"{o}|{k}|{s}": n for (o, k, s), n in self.by_size.items()}}


_state = threading.local()


class CommunicationContractError(RuntimeError):
    """A call NCCL would refuse: a tensor off the device in a collective."""


def caller() -> str:
    """Where megalite (or a test) made the call: the innermost frame outside torch, this module and the group
    helpers (GroupInfo.sum and its kin in megalite/parallel_state.py)."""
    from megalite import parallel_state
    for frame in reversed(traceback.extract_stack()[:-2]):
        if (f"{os.sep}torch{os.sep}" not in frame.filename
                and frame.filename not in (__file__, parallel_state.__file__)):
            return f"{os.path.relpath(frame.filename)}:{frame.lineno} ({frame.name})"
    return "?"


def _check_device(name: str, tensors, device: torch.device) -> None:
    for tensor in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != device.type:
            raise CommunicationContractError(
                f"{caller()}: {name} on a {tensor.device.type} tensor: NCCL serves {device.type} tensors only "
                f"(create it on the compute device)")


def _wrap(name: str, original, counter: CommCounter, nccl_device: torch.device | None = None):
    key, _ = _COLLECTIVES[name]
    signature = inspect.signature(original)

    def wrapper(*args, **kwargs):
        if getattr(_state, "depth", 0):
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        if nccl_device is not None:
            for value in bound.values():
                if isinstance(value, (torch.Tensor, list, tuple)):
                    _check_device(name, value, nccl_device)
        counter.record(name, bound.get("group"), bound[key])
        _state.depth = 1
        try:
            return original(*args, **kwargs)
        finally:
            _state.depth = 0

    wrapper.__name__ = original.__name__
    wrapper.__wrapped__ = original
    return wrapper


class _BatchWork:
    """NCCL's one Work for a coalesced batch of sends and receives: waits for all of them."""

    def __init__(self, works):
        self._works = list(works)

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _coalescing(original):
    def batch_isend_irecv(p2p_op_list):
        return [_BatchWork(original(p2p_op_list))] if p2p_op_list else []
    batch_isend_irecv.__wrapped__ = original
    return batch_isend_irecv


@contextlib.contextmanager
def count_communication(nccl_device: torch.device | None = None):
    """Count every torch.distributed collective and p2p call made inside the block (see the module docstring); with
    ``nccl_device``, also hold them to NCCL's rules."""
    counter = CommCounter()
    originals = {name: getattr(c10d, name) for name in _COLLECTIVES if hasattr(c10d, name)}
    wrappers = {name: _wrap(name, fn, counter, nccl_device) for name, fn in originals.items()}
    if nccl_device is not None:
        originals["batch_isend_irecv"] = c10d.batch_isend_irecv
        wrappers["batch_isend_irecv"] = _coalescing(c10d.batch_isend_irecv)
    by_identity = {id(fn): wrappers[name] for name, fn in originals.items()}
    patched: list[tuple[object, str, object]] = []
    # torch.distributed and its c10d module (P2POp checks and compares against the c10d globals), and every alias a
    # megalite or bench module took at import time.
    modules = [c10d, dist] + [m for n, m in list(sys.modules.items())
                              if m is not None and (n.startswith("megalite") or n.startswith("bench"))]
    for module in modules:
        for attr, value in list(vars(module).items()):
            if callable(value) and id(value) in by_identity:
                patched.append((module, attr, value))
                setattr(module, attr, by_identity[id(value)])
    try:
        yield counter
    finally:
        for module, attr, value in reversed(patched):
            setattr(module, attr, value)


class FunctionalCollectiveCounter:
    """What torch's own tensor parallelism (DTensor) sends: its functional collectives
    (``torch.distributed._functional_collectives``, which do not go through the torch.distributed functions above),
    counted by wrapping them while ``counting()`` is active. Same conventions (all-gather: the gathered tensor,
    reduce-scatter: its input)."""

    FUNCTIONS = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_gather_tensor_autograd",
                 "reduce_scatter_tensor_autograd", "all_reduce_coalesced", "all_to_all_single",
                 "all_to_all_single_autograd")

    def __init__(self):
        self.calls: dict[str, int] = defaultdict(int)
        self.elements: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def counting(self):
        import torch.distributed._functional_collectives as funcol

        originals = {name: getattr(funcol, name) for name in self.FUNCTIONS if hasattr(funcol, name)}

        def wrap(name, original):
            def wrapper(tensor, *args, **kwargs):
                out = original(tensor, *args, **kwargs)
                if not getattr(_state, "depth", 0):
                    counted = out if "all_gather" in name else tensor
                    counted = counted if isinstance(counted, (list, tuple)) else [counted]
                    self.calls[name.removesuffix("_autograd")] += 1
                    self.elements[name.removesuffix("_autograd")] += sum(t.numel() for t in counted)
                return out
            return wrapper

        for name, original in originals.items():
            setattr(funcol, name, wrap(name, original))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(funcol, name, original)
