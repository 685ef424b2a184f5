"""Rotary position embeddings (Su et al. 2021), in the rotate-half convention of Hugging Face Llama and Megatron.

Channel i of a head is paired with channel i + d/2 (not with its neighbour, the original "interleaved" form) and the
pair is rotated by position x frequency_i, frequency_i = base^(-2i/d). Weights converted from Hugging Face Llama
checkpoints, whose q_proj/k_proj rows are already permuted for this convention, need no permutation.

No parameters: cos and sin are computed in fp32 (as Hugging Face and Megatron do, so converted models give the same
logits) once per (sequence length, device) and cached on the module as plain attributes, not buffers: they are
neither saved in checkpoints nor cast to bf16 with the model.

On CUDA tensors the rotation runs as a fused kernel when the kernel policy says so (``--no-rope-fusion`` turns it
off), which applies the fp32 cos and sin as they are; the torch ops below cast them to the input's dtype first.

Partial rotary (``--rotary-percent``, as Megatron, GPT-NeoX and StableLM): the module is built for the rotated
channels only (``head_dim`` = int(head dim x percent), frequencies base^(-2i/that)); given wider heads it rotates their
first ``head_dim`` channels and passes the rest through.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.kernels import DEFAULT_POLICY, KernelPolicy, fused
from megalite.kernels.policy import ROPE


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: int, kernels: KernelPolicy = DEFAULT_POLICY):
        super().__init__()
        self.head_dim, self.base, self.kernels = head_dim, base, kernels
        self._cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, seq_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every (position, channel) angle, [seq, head_dim], fp32."""
        key = (seq_length, device)
        if key not in self._cache:
            inv_freq = 1.0 / self.base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
            angles = torch.outer(torch.arange(seq_length).float(), inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            self._cache[key] = (angles.cos().to(device), angles.sin().to(device))
        return self._cache[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None,
                length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate queries and keys, both [batch, heads, seq, channels] (all channels, or the first head_dim with
        partial rotary), at positions 0, 1, ... or at ``positions`` ([seq], or [batch, seq] for packed documents; all
        below ``length``): a context-parallel rank's tokens sit at their global positions."""
        if q.shape[-1] > self.head_dim:   # partial rotary
            split = [self.head_dim, q.shape[-1] - self.head_dim]
            (q_rot, q_pass), (k_rot, k_pass) = q.split(split, dim=-1), k.split(split, dim=-1)
            q_rot, k_rot = self(q_rot, k_rot, positions, length)
            return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)
        cos, sin = self.cos_sin(q.shape[-2] if positions is None else length, q.device)
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
            if positions.dim() == 2:   # per sample: [batch, 1, seq, head_dim], broadcast over heads (torch ops)
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        ops = self.kernels.ops(ROPE, q) if cos.dim() == 2 else None
        if ops is not None:
            return fused.rotary(q, cos, sin, ops), fused.rotary(k, cos, sin, ops)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
