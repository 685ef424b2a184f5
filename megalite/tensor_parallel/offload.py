"""Activation offloading (Megatron's --fine-grained-activation-offloading --offload-modules): what chosen parts of a
layer save for backward is moved to host memory during the forward and brought back just before their backward.

``with offloader.offloading("core_attn"):`` installs saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks)
around one part's forward. Each tensor autograd saves there is copied out, its whole storage once (the queries,
keys and values viewing one fused QKV output are one copy; a storage saved again, by a later part of the same
forward, is not copied twice), and autograd keeps a small handle instead: the device storage is freed as soon as the
forward drops its own references. Parameters stay where they are. The parts saved in one call make a group.

On a GPU the copy goes to pinned host memory on a side stream that first waits for the compute stream, so it
overlaps the compute that follows; the device storage is marked as in use by that stream (record_stream), so the
caching allocator does not hand it out again before the copy has read it, however early the forward frees it.
In backward, the first unpack of a group reloads the group on a second side stream and prefetches the group saved
before it (the next to be needed: one part ahead); the reload waits for the offload's event and for the compute
stream (the reused device memory's earlier readers), and the compute stream waits for the reload's event before
using the tensor. The reloaded storage is shared by the group's handles and freed with the last of them.

On the CPU the host is the device: the offload is a copy into a new host storage (the original is freed as on a
GPU, so what autograd keeps is measurably smaller by the offloaded bytes) and the reload hands that copy back.

Recompute: a part rerun in backward (--recompute-modules) saves only its inputs in the forward, so those are what
moves; the rerun itself happens inside backward, where the hooks are off (its tensors are used at once). A fully
recomputed layer saves nothing in its forward, so there is nothing to offload (config/validate.py refuses it).
Under pipeline parallelism several micro-batches are in flight: each model chunk's forward starts a new chain of
groups (``begin_forward``), so a prefetch never reaches into another micro-batch.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
from torch import nn


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage as a flat uint8 tensor (to copy it whole, views and all)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class _Streams:
    """The side streams of one CUDA device: device-to-host copies and host-to-device reloads."""

    def __init__(self, device: torch.device):
        self.offload, self.reload = torch.cuda.Stream(device), torch.cuda.Stream(device)


class _Copy:
    """One device storage's host copy, and once reloaded, its storage on the device again."""
    __slots__ = ("device", "host", "offloaded", "device_bytes", "reloaded", "__weakref__")

    def __init__(self, storage: torch.UntypedStorage, streams: Optional[_Streams]):
        self.device, self.device_bytes, self.reloaded, self.offloaded = storage.device, None, None, None
        source = _bytes_of(storage)
        if streams is None:   # the CPU: a copy into a new storage
            self.host = source.clone()
            return
        self.host = torch.empty(source.shape, dtype=torch.uint8, pin_memory=True)
        streams.offload.wait_stream(torch.cuda.current_stream(self.device))   # the values are written
        with torch.cuda.stream(streams.offload):
            self.host.copy_(source, non_blocking=True)
            self.offloaded = torch.cuda.Event()
            self.offloaded.record(streams.offload)
        source.record_stream(streams.offload)   # not reused before the copy has read it

    def reload(self, streams: Optional[_Streams]) -> None:
        if self.device_bytes is not None:
            return
        if streams is None:
            self.device_bytes = self.host
            return
        # Allocated on the compute stream, whose earlier kernels may still read the reused memory: wait for them.
        self.device_bytes = torch.empty(self.host.shape, dtype=torch.uint8, device=self.device)
        streams.reload.wait_stream(torch.cuda.current_stream(self.device))
        streams.reload.wait_event(self.offloaded)
        with torch.cuda.stream(streams.reload):
            self.device_bytes.copy_(self.host, non_blocking=True)
            self.reloaded = torch.cuda.Event()
            self.reloaded.record(streams.reload)
        self.device_bytes.record_stream(streams.reload)
        self.host = None   # the pinned block is reused only after the copy (torch's host allocator records it)

    def wait(self) -> None:
        if self.reloaded is not None:
            torch.cuda.current_stream(self.device).wait_event(self.reloaded)


class _Group:
    """The copies one part's forward made in one micro-batch, reloaded together; ``previous``: the group saved
    before it in the same forward, prefetched when this one is reloaded."""
    __slots__ = ("copies", "previous", "reloaded", "__weakref__")

    def __init__(self, previous: Optional["_Group"]):
        self.copies: list[_Copy] = []
        self.previous, self.reloaded = previous, False


class _Saved:
    """What autograd keeps for an offloaded tensor: its copy and how the tensor lay in the storage."""
    __slots__ = ("copy", "group", "dtype", "offset", "size", "stride")

    def __init__(self, copy: _Copy, group: _Group, tensor: torch.Tensor):
        self.copy, self.group, self.dtype = copy, group, tensor.dtype
        self.offset, self.size, self.stride = tensor.storage_offset(), tensor.size(), tensor.stride()


class ActivationOffloader:
    """The offloading of one model chunk, for the parts named in ``modules`` (see the module docstring).
    ``offloaded`` counts, per part, the tensors handed over and the bytes copied out, since construction."""

    def __init__(self, modules: frozenset[str]):
        self.modules = modules
        self.offloaded: dict[str, list[int]] = {}
        self._last: Optional[weakref.ref] = None            # the chain's latest group
        self._copies: dict[int, tuple[weakref.ref, weakref.ref]] = {}   # storage address -> (tensor, copy)
        self._streams: dict[torch.device, _Streams] = {}

    def begin_forward(self) -> None:
        """A new forward of the chunk (a micro-batch): a new chain of groups."""
        self._last, self._copies = None, {}

    def offloading(self, name: str, training: bool):
        """A context offloading what part ``name`` saves, if it is one of ``modules``, while training, with grad,
        and not inside a backward (a recompute's rerun)."""
        if (name not in self.modules or not training or not torch.is_grad_enabled()
                or torch._C._current_graph_task_id() != -1):
            return contextlib.nullcontext()
        group = _Group(self._last() if self._last is not None else None)
        self._last = weakref.ref(group)
        counts = self.offloaded.setdefault(name, [0, 0])
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, group, counts), self._unpack)

    def _streams_of(self, device: torch.device) -> Optional[_Streams]:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = _Streams(device)
        return self._streams[device]

    def _pack(self, tensor: torch.Tensor, group: _Group, counts: list[int]):
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter) or tensor.is_leaf:
            return tensor   # a parameter (or a view of one, or a leaf: a stage's received input) stays
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        known, copy = self._copies.get(key, (None, None))
        # The same storage only while the tensor that was copied lives on it (an address is reused once freed).
        copied = known() if known is not None else None
        copy = copy() if copied is not None and copied.untyped_storage().data_ptr() == key else None
        if copy is None:
            copy = _Copy(storage, self._streams_of(tensor.device))
            self._copies[key] = (weakref.ref(tensor), weakref.ref(copy))
            counts[1] += storage.nbytes()
        if copy not in group.copies:
            group.copies.append(copy)
        counts[0] += 1
        return _Saved(copy, group, tensor)

    def _unpack(self, saved) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        streams = self._streams_of(saved.copy.device)
        for group in (saved.group, saved.group.previous):   # this group, and the next one backward needs
            if group is not None and not group.reloaded:
                group.reloaded = True
                for copy in group.copies:
                    copy.reload(streams)
        saved.copy.wait()
        storage = saved.copy.device_bytes.untyped_storage()
        return torch.empty(0, dtype=saved.dtype, device=saved.copy.device).set_(storage, saved.offset, saved.size,
                                                                                  saved.stride)


def offloading(offloader: Optional[ActivationOffloader], name: str, training: bool):
    """``offloader.offloading(name, training)``, or nothing without an offloader."""
    return contextlib.nullcontext() if offloader is None else offloader.offloading(name, training)
