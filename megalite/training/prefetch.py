"""The next global batch's samples, assembled in the background while this one trains.

One worker thread reads and stacks the next global batch's micro-batches (reading memory-mapped samples and
``torch.stack`` release the GIL, so it runs beside the training thread's forward and backward); on a GPU it puts them
in pinned memory so the training thread's copy to the device is asynchronous (``non_blocking=True``). Batches are
keyed by the samples consumed before them and their micro-batch count: a step takes the prefetched batch only if its
key is the one asked for ahead, otherwise (the first step, after a resume, or with ``--no-data-prefetch``) it builds
its own on the spot. So which samples a step trains on never depends on the prefetch, and resuming stays exact.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

Key = tuple[int, int]   # (consumed samples before the batch, micro-batches in it)


class BatchPrefetcher:
    def __init__(self, build: Callable[[int, int], list[torch.Tensor]], enabled: bool = True):
        """``build(consumed_samples, num_micro_batches)``: the batch's micro-batches of samples, on the host."""
        self._build = build
        self._executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalite-prefetch")
                          if enabled else None)
        self._ahead: Optional[tuple[Key, Future]] = None

    def get(self, consumed_samples: int, num_micro_batches: int) -> list[torch.Tensor]:
        """The batch's samples: the prefetched ones when this is the batch asked for ahead, else built now. An error
        of the background build is raised here, on the training thread."""
        key = (consumed_samples, num_micro_batches)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == key:
            return ahead[1].result()
        if ahead is not None:
            ahead[1].cancel()
        return self._build(*key)

    def ahead(self, consumed_samples: int, num_micro_batches: int) -> None:
        """Start building this batch in the background (replacing one asked for before and not taken)."""
        if self._executor is None:
            return
        if self._ahead is not None:
            self._ahead[1].cancel()
        key = (consumed_samples, num_micro_batches)
        self._ahead = (key, self._executor.submit(self._build, *key))

    def close(self) -> None:
        """Stop the worker (after the batch it is building, if any)."""
        self._ahead = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
