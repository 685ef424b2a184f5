"""Causal self-attention with heads split over tensor-parallel ranks.

One column-parallel projection makes q, k and v together (its weight is the stack [Wq; Wk; Wv], each block split by
heads, so a rank gets the q, k and v of the same heads); attention runs on this rank's heads only, through torch's
scaled_dot_product_attention; a row-parallel projection sums the heads' contributions back into the residual stream.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite import parallel_state
from megalite.config import ModelConfig
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelRNG


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rng: TensorParallelRNG | None):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = cfg.num_attention_heads // tp
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.dropout = cfg.attention_dropout
        self.rng = rng
        output_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)   # Megatron's scaled init of outputs
        self.linear_qkv = ColumnParallelLinear(cfg.hidden_size, 3 * cfg.hidden_size, fused=3,
                                               init_std=cfg.init_method_std)
        self.linear_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, init_std=output_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.linear_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        # Attention probabilities belong to this rank's heads: their dropout draws from the per-TP-rank stream.
        with self.rng.fork() if dropout > 0 else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.linear_proj(context.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))
