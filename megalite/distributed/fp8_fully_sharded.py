"""--fp8-param-gather at ZeRO-3: FSDP2 all-gathers the FP8 linears' weights as FP8 bytes.

FSDP2 lets a sharded parameter's local tensor say what to all-gather (its all-gather extension:
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the tensor). megalite wraps each FP8 linear's fp32 weight in
:class:`Fp8ShardedWeight` before ``fully_shard``: an ordinary fp32 tensor for every op (the optimizer steps the plain
tensor inside it), whose pre-all-gather quantizes the shard, in the compute dtype as FSDP2 would have cast it, with
the whole weight's scale, and hands FSDP2 the bytes (uint8: gloo refuses FP8 types); its post-all-gather returns an
:class:`Fp8GatheredWeight`, the FP8 values with their inverse scale, which the FP8 linear multiplies by directly
(megalite.tensor_parallel.fp8_linear reads its ``fp8_gathered``). Half of bf16's bytes for those weights, in forward
and in backward's re-gather alike.

The scale is the one the forward would have computed from the gathered weight (so the run is the same, bit for
bit): tensorwise (and delayed before its first history entry), fp8_max / amax with the amax maxed over the DP shards
and TP, for all FP8 weights of the rank in one all-reduce each; delayed, the history's, the shard's amax recorded as
the step's weight amax. :class:`Fp8ShardScales` computes them when a gather first needs them after the optimizer
step (every rank gathers the layers in the same order, so the all-reduces line up) and keeps them for the backward's
re-gathers.

FSDP2 re-pads a subclass shard into new storage when the rows do not split evenly over DP, which would cut it off
from the optimizer's view of it: the configuration check asks for even rows (megalite.config.validate).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.utils._pytree as pytree

from megalite import parallel_state
from megalite.parallel_state import GroupInfo
from megalite.tensor_parallel.fp8 import E4M3, amax, quantize
from megalite.tensor_parallel.fp8_linear import GatheredFp8Weight, gathered_weight_scales

aten = torch.ops.aten
# The ops FSDP2 applies to a parameter while sharding it (chunk, pad, copy, view, narrow) and those making
# parameters of it: their results stay Fp8ShardedWeight; every other op sees the plain tensor.
_KEEP_SHARD = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default,
               aten.view.default, aten.as_strided.default, aten.split.Tensor, aten.clone.default,
               aten.detach.default, aten.alias.default, aten._to_copy.default}


class Fp8ShardScales:
    """The scales of one engine's FP8 weights for the current weights: computed together when a gather first asks
    after an update (:meth:`invalidate`), in one all-reduce over DP and one over TP (tensorwise)."""

    def __init__(self, compute_dtype: torch.dtype, data_group: GroupInfo):
        self.compute_dtype, self.data_group = compute_dtype, data_group   # the ranks holding the other shards
        self.weights: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []   # (linear, its sharded DTensor weight)
        self.scales: Optional[dict[int, torch.Tensor]] = None                 # id(linear) -> scale

    def invalidate(self) -> None:
        self.scales = None

    @torch.no_grad()
    def scale_of(self, linear: torch.nn.Module) -> torch.Tensor:
        if self.scales is None:
            self._compute()
        return self.scales[id(linear)]

    def _compute(self) -> None:
        locals_ = [weight.to_local() for _, weight in self.weights]
        amaxes = torch.zeros(len(self.weights), device=locals_[0].device)
        for i, local in enumerate(locals_):
            if local.numel():
                amaxes[i] = amax(plain(local).to(self.compute_dtype))
        linears = [linear for linear, _ in self.weights]
        groups = (self.data_group, parallel_state.get_tensor_model_parallel_group())
        scales = gathered_weight_scales(linears, amaxes, groups)
        self.scales = {id(linear): scale for linear, scale in zip(linears, scales)}


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside an Fp8ShardedWeight (the tensor itself otherwise): same storage."""
    return tensor._tensor if isinstance(tensor, Fp8ShardedWeight) else tensor


class Fp8ShardedWeight(torch.Tensor):
    """An FP8 linear's fp32 weight (and, once FSDP2 has cut it, this rank's shard) with FSDP2's all-gather extension."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, linear: torch.nn.Module, scales: Fp8ShardScales):
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   layout=tensor.layout, device=tensor.device,
                                                   requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, linear: torch.nn.Module, scales: Fp8ShardScales):
        self._tensor, self._linear, self._scales = tensor, linear, scales

    def __repr__(self):
        return f"Fp8ShardedWeight({self._tensor})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        owner = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Fp8ShardedWeight))
        args, kwargs = pytree.tree_map_only(Fp8ShardedWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SHARD:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: Fp8ShardedWeight(t, owner._linear, owner._scales), out)

    def __tensor_flatten__(self):
        return ["_tensor"], (self._linear, self._scales)

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        return Fp8ShardedWeight(inner["_tensor"], *context)

    def fsdp_pre_all_gather(self, mesh):
        """This shard in FP8 (as bytes) and its scale. (FSDP2's oldest, one-argument form, which the newer torch
        releases still take; the rows split evenly, so the shard needs no padding.)"""
        scale = self._scales.scale_of(self._linear)
        shard = self._tensor.to(self._scales.compute_dtype)
        return (quantize(shard, scale, E4M3).view(torch.uint8),), (scale,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,), (scale,) = outputs, metadata
        if out is not None:   # a later gather into the same storage: only the scale is new
            target = out._local_tensor if hasattr(out, "_local_tensor") else out
            target._inverse_scale = scale.reciprocal()
            return None
        return Fp8GatheredWeight(data.view(E4M3), scale.reciprocal(), param_dtype), (data,)


class Fp8GatheredWeight(torch.Tensor):
    """A gathered FP8 weight posing as the weight in its compute dtype: the FP8 linear takes its values and inverse
    scale as they are (``fp8_gathered``); any other op sees them dequantized."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, inverse_scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=dtype,
                                                   device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, inverse_scale: torch.Tensor, dtype: torch.dtype):
        self._data, self._inverse_scale = data, inverse_scale

    def __repr__(self):
        return f"Fp8GatheredWeight({self.shape}, inverse scale {self._inverse_scale})"

    @property
    def fp8_gathered(self) -> GatheredFp8Weight:
        return GatheredFp8Weight(self._data, self._inverse_scale, self._version)

    # Views of the gathered weight (FSDP2 takes one of the original size, then makes a parameter of it) stay FP8.
    _VIEWS = {aten.as_strided.default, aten.view.default, aten.detach.default, aten.alias.default,
              aten.slice.Tensor}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in cls._VIEWS and isinstance(args[0], Fp8GatheredWeight):
            weight = args[0]
            return Fp8GatheredWeight(func(weight._data, *args[1:], **kwargs), weight._inverse_scale, weight.dtype)
        args, kwargs = pytree.tree_map_only(
            Fp8GatheredWeight, lambda t: (t._data.float() * t._inverse_scale).to(t.dtype), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_inverse_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["_data"], inner["_inverse_scale"], dtype)


def wrap_fp8_weights(modules: list[torch.nn.Module], scales: Fp8ShardScales) -> list[torch.nn.Module]:
    """Put each FP8 linear's weight (not a routed expert's) in an Fp8ShardedWeight, before ``fully_shard``; the
    linears wrapped. megalite's marks on the weights (partition, full shape, ...) move to the new parameters."""
    wrapped = []
    for m in modules:
        for sub in m.modules():
            weight = getattr(sub, "weight", None)
            if (getattr(sub, "fp8", None) is None or not isinstance(weight, torch.nn.Parameter)
                    or getattr(weight, "is_expert", False) or isinstance(weight.data, Fp8ShardedWeight)):
                continue
            new = torch.nn.Parameter(Fp8ShardedWeight(weight.data, sub, scales), requires_grad=weight.requires_grad)
            for key, value in vars(weight).items():
                setattr(new, key, value)
            sub.weight = new
            wrapped.append(sub)
    return wrapped
