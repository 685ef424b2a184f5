"""Rotary position embeddings (Su et al. 2021), in the rotate-half convention of Hugging Face Llama and Megatron.

Channel i of a head is paired with channel i + d/2 (not with its neighbour, the original "interleaved" form) and the
pair is rotated by position x frequency_i, frequency_i = base^(-2i/d). Weights converted from Hugging Face Llama
checkpoints, whose q_proj/k_proj rows are already permuted for this convention, need no permutation.

Llama 3.1's rope scaling (``--use-rope-scaling``; Hugging Face's rope type ``llama3``) stretches the long wavelengths
to a longer context: a frequency whose wavelength 2 pi / f exceeds original_context / low_freq_factor is divided by
the factor, one shorter than original_context / high_freq_factor is kept, and those between are interpolated,
f' = (1 - a) f / factor + a f with a = (original_context / wavelength - low) / (high - low). Computed with the same
fp32 operations as Hugging Face's, so imported Llama 3.1/3.2 models give the same logits.

No parameters: cos and sin are computed in fp32 (as Hugging Face and Megatron do, so converted models give the same
logits) for the longest sequence seen so far per device and cached on the module as plain attributes, not buffers: they
are neither saved in checkpoints nor cast to bf16 with the model. ``offset`` rotates positions offset, offset + 1,
... (the new tokens of generation with a KV cache).

On CUDA tensors the rotation runs as a fused kernel when the kernel policy says so (``--no-rope-fusion`` turns it
off), which applies the fp32 cos and sin as they are; the torch ops below cast them to the input's dtype first.

Partial rotary (``--rotary-percent``, as Megatron, GPT-NeoX and StableLM): the module is built for the rotated
channels only (``head_dim`` = int(head dim x percent), frequencies base^(-2i/that)); given wider heads it rotates their
first ``head_dim`` channels and passes the rest through.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy, fused
from megalite.kernels.policy import ROPE


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency scaling (Hugging Face ``rope_type: llama3``)."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> Optional[RopeScaling]:
        """The model's rope scaling, None without --use-rope-scaling."""
        if not cfg.use_rope_scaling:
            return None
        return cls(cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor,
                   cfg.rope_scaling_original_max_position_embeddings)

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        low_freq_wavelength = self.original_max_positions / self.low_freq_factor
        high_freq_wavelength = self.original_max_positions / self.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_positions / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        between = ~(wavelength < high_freq_wavelength) * ~(wavelength > low_freq_wavelength)
        return torch.where(between, smoothed, scaled)


def inverse_frequencies(head_dim: int, base: int, scaling: Optional[RopeScaling] = None) -> torch.Tensor:
    """The head_dim / 2 rotation frequencies base^(-2i/d), fp32, scaled when ``scaling`` is given."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return inv_freq if scaling is None else scaling.apply(inv_freq)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: int, kernels: KernelPolicy = DEFAULT_POLICY,
                 scaling: Optional[RopeScaling] = None):
        super().__init__()
        self.head_dim, self.base, self.kernels, self.scaling = head_dim, base, kernels, scaling
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, seq_length: int, device: torch.device, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every (position, channel) angle for positions offset .. offset + seq_length - 1,
        [seq, head_dim], fp32. A position's angles do not depend on the table's length, so one table serves all."""
        end = offset + seq_length
        if device not in self._cache or self._cache[device][0].shape[0] < end:
            angles = torch.outer(torch.arange(end).float(), inverse_frequencies(self.head_dim, self.base,
                                                                                 self.scaling))
            angles = torch.cat([angles, angles], dim=-1)
            self._cache[device] = (angles.cos().to(device), angles.sin().to(device))
        cos, sin = self._cache[device]
        return cos[offset:end], sin[offset:end]

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None,
                length: int | None = None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys, both [batch, heads, seq, channels] (all channels, or the first head_dim with
        partial rotary), at positions offset, offset + 1, ... (offset: the tokens already in a KV cache) or at
        ``positions`` ([seq], or [batch, seq] for packed documents; all below ``length``): a context-parallel rank's
        tokens sit at their global positions."""
        if q.shape[-1] > self.head_dim:   # partial rotary
            split = [self.head_dim, q.shape[-1] - self.head_dim]
            (q_rot, q_pass), (k_rot, k_pass) = q.split(split, dim=-1), k.split(split, dim=-1)
            q_rot, k_rot = self(q_rot, k_rot, positions, length, offset)
            return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)
        if positions is None:
            cos, sin = self.cos_sin(q.shape[-2], q.device, offset)
        else:
            cos, sin = self.cos_sin(length, q.device)
            cos, sin = cos[positions], sin[positions]
            if positions.dim() == 2:   # per sample: [batch, 1, seq, head_dim], broadcast over heads (torch ops)
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        ops = self.kernels.ops(ROPE, q) if cos.dim() == 2 else None
        if ops is not None:
            return fused.rotary(q, cos, sin, ops), fused.rotary(k, cos, sin, ops)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
