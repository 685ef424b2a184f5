"""Replicated modules (norms, learned position embeddings) marked for layout-independent initialization.

A norm is LayerNorm or RMSNorm (Zhang & Sennrich 2019: x / rms(x) * g, no bias, no centering; Llama's). Both keep
only their input and per-token statistics for backward, like the fused kernels of Megatron/apex. Under sequence
parallelism a norm sees only this rank's sequence shard, so its parameters are flagged ``sequence_parallel``: the
data-parallel engine sums their gradients over TP.

On CUDA tensors both run as fused kernels when the kernel policy says so (``--use-fused-kernels``,
``--no-layernorm-fusion``); elsewhere LayerNorm is torch's and RMSNorm the torch ops of ``megalite.kernels.torch_ops``.

``--apply-layernorm-1p`` (Megatron's zero-centred gamma) stores the scale minus one: the weight starts at 0 and the
norm multiplies by (1 + weight), so the learned part is small and keeps its precision in low-precision copies of the
weights. Gemma's RMSNorm is this form.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy, fused, torch_ops
from megalite.kernels.policy import LAYERNORM
from megalite.tensor_parallel import mark_sequence_parallel
from megalite.tensor_parallel.partition import REPLICATED, mark, normal_init, ones_init, zeros_init


class RMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * weight, in fp32 whatever the input dtype; saves x and the per-token rstd.
    ``zero_centered``: the scale is (1 + weight), added in fp32 (Gemma's RMSNorm: 1 + w rounded to bf16 would lose
    the small w the zero-centred form keeps precise; a fused kernel gets it in the input's dtype)."""

    def __init__(self, hidden_size: int, eps: float, kernels: KernelPolicy = DEFAULT_POLICY,
                 zero_centered: bool = False):
        super().__init__()
        self.eps, self.kernels, self.zero_centered = eps, kernels, zero_centered
        self.weight = nn.Parameter(torch.zeros(hidden_size) if zero_centered else torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() + 1 if self.zero_centered else self.weight
        return fused.rms_norm(x, weight, self.eps, self.kernels.ops(LAYERNORM, x) or torch_ops)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (same parameters and state dict), run by the fused kernel where the policy picks it.
    ``zero_centered``: the scale is (1 + weight)."""

    def __init__(self, hidden_size: int, eps: float, kernels: KernelPolicy = DEFAULT_POLICY,
                 zero_centered: bool = False):
        super().__init__(hidden_size, eps=eps)
        self.kernels, self.zero_centered = kernels, zero_centered
        if zero_centered:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        ops = self.kernels.ops(LAYERNORM, x)
        if ops is None:
            return torch.nn.functional.layer_norm(x, self.normalized_shape, weight, self.bias, self.eps)
        return fused.layer_norm(x, weight, self.bias, self.eps, ops)


def layer_norm(hidden_size: int, eps: float, kernels: KernelPolicy = DEFAULT_POLICY,
               zero_centered: bool = False) -> LayerNorm:
    """A LayerNorm every TP rank holds whole; its gradients agree across TP because its inputs do."""
    norm = LayerNorm(hidden_size, eps, kernels, zero_centered)
    mark(norm.weight, norm.weight.shape, REPLICATED, zeros_init if zero_centered else ones_init)
    mark(norm.bias, norm.bias.shape, REPLICATED, zeros_init)
    return norm


def norm(cfg: ModelConfig, sequence_parallel: bool = False, kernels: KernelPolicy = DEFAULT_POLICY) -> nn.Module:
    """The configured norm (LayerNorm or RMSNorm) over the hidden size, replicated over TP."""
    zero_centered = cfg.apply_layernorm_1p
    if cfg.normalization == "RMSNorm":
        module = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon, kernels, zero_centered)
        mark(module.weight, module.weight.shape, REPLICATED, zeros_init if zero_centered else ones_init)
    else:
        module = layer_norm(cfg.hidden_size, cfg.layernorm_epsilon, kernels, zero_centered)
    if sequence_parallel:
        for param in module.parameters():
            mark_sequence_parallel(param)
    return module


def position_embedding(max_positions: int, hidden_size: int, init_std: float) -> nn.Embedding:
    table = nn.Embedding(max_positions, hidden_size)
    mark(table.weight, table.weight.shape, REPLICATED, normal_init(init_std))
    table.weight.is_position_embedding = True   # a table, not a map: AdamW steps it under --optimizer muon
    return table
