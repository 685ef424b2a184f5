"""Random streams for dropout under tensor parallelism.

Dropout on tensors that every TP rank holds whole (embeddings, the residual stream) must draw the *same* mask on
every TP rank, or the replicas drift apart. Dropout on tensors split over TP (attention probabilities of this rank's
heads) must draw *different* masks, or the heads of different ranks would share one pattern. So there are two
streams: the device's default generator, seeded identically on the TP ranks of a stage, and a tracked
"tensor-parallel" stream seeded per TP rank, entered with ``with tracker.fork():`` around split-region dropout.
Under sequence parallelism the residual stream is split too, so its dropout also draws from the tensor-parallel
stream. Context-parallel ranks hold different tokens (and, with the all-to-all, different heads): both their streams
are seeded apart too (an offset per CP rank; none at CP rank 0, so a run without CP keeps Megatron's seeds). Recompute saves both states before a forward and replays them (``get_states``/``set_states``), so the
recomputed forward draws the same masks.
"""

from __future__ import annotations

import contextlib

import torch

_DEFAULT_SEED_OFFSET_PER_STAGE = 100     # Megatron's offsets, so seeds match its conventions
_TENSOR_PARALLEL_SEED_OFFSET = 2718
_CONTEXT_PARALLEL_SEED_OFFSET = 1_000_003   # beyond any stage's offset, so no two (stage, CP rank) seeds meet


class TensorParallelRNG:
    """Owns the tensor-parallel dropout stream of one rank and swaps it in and out of the device generator."""

    def __init__(self, seed: int, tp_rank: int, pp_rank: int, device: torch.device, cp_rank: int = 0):
        self.device = torch.device(device)
        self.default_seed = seed + _DEFAULT_SEED_OFFSET_PER_STAGE * pp_rank + _CONTEXT_PARALLEL_SEED_OFFSET * cp_rank
        self.tensor_parallel_seed = self.default_seed + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank
        torch.manual_seed(self.default_seed)   # seeds the CPU and every CUDA generator
        self._tp_state = self._fresh_state(self.tensor_parallel_seed)

    def _get_state(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _fresh_state(self, seed: int) -> torch.Tensor:
        saved = self._get_state()
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        state = self._get_state()
        self._set_state(saved)
        return state

    def get_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(default stream, tensor-parallel stream): everything dropout draws from, for recompute to replay."""
        return self._get_state(), self._tp_state

    def set_states(self, states: tuple[torch.Tensor, torch.Tensor]) -> None:
        default, tensor_parallel = states
        self._set_state(default)
        self._tp_state = tensor_parallel   # never mutated in place: fork() replaces it with a fresh state tensor

    @contextlib.contextmanager
    def fork(self):
        """Draw random numbers from this rank's tensor-parallel stream inside the block."""
        outer = self._get_state()
        self._set_state(self._tp_state)
        try:
            yield
        finally:
            self._tp_state = self._get_state()
            self._set_state(outer)
