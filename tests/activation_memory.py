"""Activation memory of a transformer layer: measured from what autograd saves, and Korthikanti et al.'s formulas.

``saved_bytes`` runs a forward under saved-tensor hooks and adds up the distinct storages autograd keeps for
backward (parameters excluded): a saved view keeps its whole storage alive, so storages, not tensors, are counted.
``HeldActivations`` does the same over a whole pipeline schedule, counting what is still held at any moment: what
autograd keeps for backwards still to run (a saved tensor is released when its node's backward has run) and what
a zero-bubble schedule's deferred weight gradients keep until their W step.

``korthikanti_bytes`` is Table 2 of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", per layer, written with the bytes of an activation element (p) and of a dropout-mask element (m) left free:

    no recompute, TP t:        sbh (4p + 2m) + sbh 12p / t + as^2b (2p + m) / t
    sequence parallel:         (the same with the first term / t too)
    selective recompute:       drops the as^2b term (softmax output, its dropout mask, dropout output)
    full recompute:            sbh p (/ t with sequence parallel): the layer input only

where 4p + 2m are the norm inputs, the QKV and fc1 inputs and the two residual dropout masks (replicated over TP),
and 12p are Q, K, V, the projection input and the two 4h-wide MLP activations (split over TP). With p = 2, m = 1
(fp16 activations, byte masks, the paper's setting) this is sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)),
sbh/t (34 + 5as/h), 34 sbh/t and 2sbh. Adjusted to this model on the CPU: fp32 activations (p = 4); dropout keeps
its float scaling noise, not a byte mask (m = 4); attention with dropout runs torch's unfused math path, which keeps
exactly the paper's tensors; and LayerNorm also keeps its per-token mean and 1/std (2 x 4 bytes x sb per norm),
which the paper neglects.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch


def saved_bytes(function: Callable[..., torch.Tensor], *inputs: torch.Tensor,
                exclude: list[torch.Tensor] = ()) -> tuple[int, torch.Tensor]:
    """(bytes of distinct storages saved for backward by ``function(*inputs)``, its output); keep the output
    alive while the number matters, since it holds the graph."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = function(*inputs)
    # Sized after the forward: a storage freed once saved (--recompute-modules layernorm, moe_act) counts nothing.
    return sum(storage.nbytes() for storage in storages.values()), output


class _Held:
    """What a saved-tensor pack hook returns: autograd drops it when it no longer needs the tensor."""
    __slots__ = ("tensor", "counts")

    def __init__(self, tensor: torch.Tensor, counts: dict[int, list[int]]):
        self.tensor, self.counts = tensor, counts
        entry = counts.setdefault(tensor.untyped_storage().data_ptr(), [0, tensor.untyped_storage().nbytes()])
        entry[0] += 1

    def __del__(self):
        key = self.tensor.untyped_storage().data_ptr()
        self.counts[key][0] -= 1
        if not self.counts[key][0]:
            del self.counts[key]


class HeldActivations:
    """Bytes of distinct storages held for backward inside ``tracking()``, read by ``sample()`` (parameters
    excluded; ``also`` adds tensors held elsewhere, e.g. a WeightGradStore's)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.counts: dict[int, list[int]] = {}
        self.peak = 0

    def _pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self.excluded:
            return tensor
        return _Held(tensor, self.counts)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    @contextlib.contextmanager
    def tracking(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    def sample(self, also: Iterable[torch.Tensor] = ()) -> int:
        storages = {key: nbytes for key, (_, nbytes) in self.counts.items()}
        for t in also:
            if t.untyped_storage().data_ptr() not in self.excluded:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        held = sum(storages.values())
        self.peak = max(self.peak, held)
        return held


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                      recompute: str | None = None, p: int = 2, m: int = 1) -> float:
    """Activation bytes per layer by Korthikanti et al. 2022 (see the module docstring for p and m)."""
    sbh = s * b * h
    if recompute == "full":
        return p * sbh / (t if sequence_parallel else 1)
    replicated, split = 4 * p + 2 * m, 12 * p
    per_sbh = (replicated + split) / t if sequence_parallel else replicated + split / t
    if recompute != "selective":
        per_sbh += (2 * p + m) * a * s / h / t
    return sbh * per_sbh


def layer_norm_statistics_bytes(s: int, b: int, t: int = 1, *, sequence_parallel: bool = False) -> float:
    """Two LayerNorms, each keeping a mean and a 1/std per token in fp32 (not in the paper's count)."""
    return 2 * 2 * 4 * s * b / (t if sequence_parallel else 1)
