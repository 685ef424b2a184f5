"""Device memory of a simulated GPU: every storage the run allocates on the meta device, live bytes and their peak.

torch's allocator statistics do not exist for meta tensors, and torch's ``MemTracker`` (torch.distributed._tools)
refuses a module run twice in one iteration (every micro-batch does). So this is a small tracker of its own: a
``TorchDispatchMode`` sees every op's outputs; each new storage is weakly referenced, its bytes added while it lives
and taken away when it is freed (a weakref callback), as the CUDA caching allocator's "allocated" counts them
(without its rounding to 512-byte blocks). At each new peak the live storages are remembered, so that afterwards
they are put in the categories the planner uses: weights, gradients, optimizer states (the tensors the run names as
such, see :meth:`MemoryTracker.categorize`) and activations (everything else: what forward keeps for backward, the
communication buffers and the temporaries of the moment).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

CATEGORIES = ("weights", "gradients", "optimizer", "activations")


class MemoryTracker(TorchDispatchMode):
    """Tracks meta storages created while active, and any registered with :meth:`track` (built before)."""

    def __init__(self, device_type: str = "meta"):
        super().__init__()
        self.device_type = device_type
        # Meta storages have no address: a live storage is known by the id of its (preserved) Python object, and
        # by a serial number that no later storage reuses (ids are reused once an object dies).
        self.live: dict[int, tuple[int, int]] = {}   # id(storage) -> (serial, bytes)
        self._refs: dict[int, weakref.ref] = {}
        self._serial = 0
        self.current = 0
        self.peak = 0
        self.peak_storages: dict[int, int] = {}   # the live storages at the peak: serial -> bytes
        self.peak_label = ""
        self.label = ""                          # what the run is doing (set by the driver), kept at the peak

    def _storages(self, tensor):
        """The storages holding ``tensor``'s memory: its own, or those of the tensors inside a wrapper subclass
        (a DTensor's local shard: the wrapper's own storage is only a shape)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device_type:
            return
        if is_traceable_wrapper_subclass(tensor):
            for name in tensor.__tensor_flatten__()[0]:
                yield from self._storages(getattr(tensor, name))
        else:
            yield tensor.untyped_storage()

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            for storage in self._storages(tensor):
                self._add(storage)

    def _add(self, storage) -> None:
        key = id(storage)
        if key in self.live:
            return
        size = storage.nbytes()
        if size == 0:
            return
        self._serial += 1
        self.live[key] = (self._serial, size)

        def freed(_, key=key):
            serial, size = self.live.pop(key, (0, 0))
            self.current -= size
            self._refs.pop(key, None)
        self._refs[key] = weakref.ref(storage, freed)
        self.current += size
        self._note_peak()

    def _note_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
            self.peak_storages = dict(self.live.values())
            self.peak_label = self.label

    def resized(self, storage, nbytes: int) -> None:
        """A storage resized in place (``untyped_storage().resize_``: how FSDP2 frees and re-allocates the gathered
        parameters, and how the pipeline frees a sent activation), as the allocator would see it."""
        known = self.live.get(id(storage))
        if known is None:
            if nbytes:
                self._add(storage)
            return
        serial, size = known
        self.live[id(storage)] = (serial, nbytes)
        self.current += nbytes - size
        self._note_peak()

    def __enter__(self):
        tracker, original = self, torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = original(storage, size)
            if storage.device.type == tracker.device_type:
                tracker.resized(storage, storage.nbytes())
            return out
        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(tree_leaves(out))
        return out

    def categorize(self, named: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
        """The peak's bytes by category; ``named`` maps weights / gradients / optimizer to the run's tensors of
        that kind (a storage named twice counts once, in the first category)."""
        owner: dict[int, str] = {}
        for category in ("weights", "gradients", "optimizer"):
            for tensor in named.get(category, ()):
                for storage in self._storages(tensor):
                    known = self.live.get(id(storage))
                    if known is not None:
                        owner.setdefault(known[0], category)
        totals = defaultdict(int)
        for serial, size in self.peak_storages.items():
            totals[owner.get(serial, "activations")] += size
        return {category: totals.get(category, 0) for category in CATEGORIES}
