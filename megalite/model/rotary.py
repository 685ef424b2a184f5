"""Rotary position embeddings (Su et al. 2021), in the rotate-half convention of Hugging Face Llama and Megatron.

Channel i of a head is paired with channel i + d/2 (not with its neighbour, the original "interleaved" form) and the
pair is rotated by position x frequency_i, frequency_i = base^(-2i/d). Weights converted from Hugging Face Llama
checkpoints, whose q_proj/k_proj rows are already permuted for this convention, need no permutation.

Rope scaling (``--use-rope-scaling``, Hugging Face's rope types) adapts the frequencies to a longer context, each
computed with the same fp32 operations as Hugging Face's ``ROPE_INIT_FUNCTIONS``, so imported models give the same
logits:

- ``llama3`` (Llama 3.1) stretches the long wavelengths: a frequency whose wavelength 2 pi / f exceeds
  original_context / low_freq_factor is divided by the factor, one shorter than original_context / high_freq_factor is
  kept, and those between are interpolated, f' = (1 - a) f / factor + a f with a = (original_context / wavelength -
  low) / (high - low).
- ``linear`` divides every frequency by the factor (position interpolation: positions / factor).
- ``yarn`` (Peng et al. 2023) keeps the frequencies that turn more than beta_fast times over the original context,
  divides by the factor those that turn fewer than beta_slow times, and ramps linearly (in the channel index, the
  bounds rounded outwards) between; cos and sin are multiplied by the attention factor (0.1 ln factor + 1 unless
  set, or DeepSeek's mscale ratio), which scales the attention logits by its square.

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
from typing import Optional, Union

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy, fused
from megalite.kernels.policy import ROPE


def plain_frequencies(head_dim: int, base: int) -> torch.Tensor:
    """The head_dim / 2 rotation frequencies base^(-2i/d), fp32."""
    return 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency scaling (Hugging Face ``rope_type: llama3``)."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int
    attention_factor = 1.0

    def frequencies(self, head_dim: int, base: int) -> torch.Tensor:
        inv_freq = plain_frequencies(head_dim, base)
        low_freq_wavelength = self.original_max_positions / self.low_freq_factor
        high_freq_wavelength = self.original_max_positions / self.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_positions / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        between = ~(wavelength < high_freq_wavelength) * ~(wavelength > low_freq_wavelength)
        return torch.where(between, smoothed, scaled)


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (Hugging Face ``rope_type: linear``): every frequency divided by the factor."""
    factor: float
    attention_factor = 1.0

    def frequencies(self, head_dim: int, base: int) -> torch.Tensor:
        return plain_frequencies(head_dim, base) / self.factor


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN (Hugging Face ``rope_type: yarn``; Megatron's YarnRotaryEmbedding)."""
    factor: float
    original_max_positions: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    attention_factor_override: Optional[float] = None
    rounded: bool = True   # the correction range's channel bounds rounded outwards (Hugging Face's truncate)

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by."""
        if self.attention_factor_override is not None:
            return self.attention_factor_override

        def concentration(mscale: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * mscale * math.log(self.factor) + 1.0
        if self.mscale and self.mscale_all_dim:
            return float(concentration(self.mscale) / concentration(self.mscale_all_dim))
        return concentration(1)

    def frequencies(self, head_dim: int, base: int) -> torch.Tensor:
        def channel(rotations: float) -> float:
            """The (fractional) channel pair whose frequency turns ``rotations`` times over the original context."""
            return head_dim * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low, high = channel(self.beta_fast), channel(self.beta_slow)
        if self.rounded:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001   # as Hugging Face: no division by zero
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        kept = 1 - ramp
        wavelength_scale = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        return 1.0 / (self.factor * wavelength_scale) * (1 - kept) + 1.0 / wavelength_scale * kept


RopeScaling = Union[Llama3Scaling, LinearScaling, YarnScaling]


def rope_scaling(cfg: ModelConfig) -> Optional[RopeScaling]:
    """The model's rope scaling, None without --use-rope-scaling."""
    if not cfg.use_rope_scaling:
        return None
    if cfg.rope_scaling_type == "linear":
        return LinearScaling(cfg.rope_scaling_factor)
    if cfg.rope_scaling_type == "yarn":
        return YarnScaling(cfg.rope_scaling_factor, cfg.rope_scaling_original_max_position_embeddings, cfg.beta_fast,
                           cfg.beta_slow, cfg.mscale, cfg.mscale_all_dim, cfg.rope_scaling_attention_factor,
                           rounded=not cfg.yarn_unrounded_correction_range)
    return Llama3Scaling(cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor,
                         cfg.rope_scaling_original_max_position_embeddings)


def inverse_frequencies(head_dim: int, base: int, scaling: Optional[RopeScaling] = None) -> torch.Tensor:
    """The head_dim / 2 rotation frequencies base^(-2i/d), fp32, scaled when ``scaling`` is given."""
    return plain_frequencies(head_dim, base) if scaling is None else scaling.frequencies(head_dim, base)


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
            scale = 1.0 if self.scaling is None else self.scaling.attention_factor
            cos, sin = (angles.cos(), angles.sin()) if scale == 1 else (angles.cos() * scale, angles.sin() * scale)
            self._cache[device] = (cos.to(device), sin.to(device))
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
