"""A pre-LayerNorm transformer layer: x + Dropout(Attn(LN(x))), then x + Dropout(MLP(LN(x)))."""

from __future__ import annotations

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.model.attention import SelfAttention
from megalite.model.mlp import MLP
from megalite.model.norms import layer_norm
from megalite.tensor_parallel import TensorParallelRNG


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rng: TensorParallelRNG | None):
        super().__init__()
        self.input_norm = layer_norm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.self_attention = SelfAttention(cfg, rng)
        self.pre_mlp_norm = layer_norm(cfg.hidden_size, cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)
        # The residual stream is whole on every TP rank: its dropout uses the default stream, equal across TP.
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.input_norm(x)))
        return x + self.dropout(self.mlp(self.pre_mlp_norm(x)))
