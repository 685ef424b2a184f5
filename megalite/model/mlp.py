"""The transformer MLP: h -> ffn column-parallel, GeLU on this rank's slice, ffn -> h row-parallel."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        output_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_size, init_std=cfg.init_method_std)
        self.linear_fc2 = RowParallelLinear(cfg.ffn_size, cfg.hidden_size, init_std=output_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))
