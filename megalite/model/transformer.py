"""A pre-norm transformer layer: x + Dropout(Attn(Norm(x))), then x + Dropout(MLP(Norm(x))) (the MLP a mixture of
experts in the layers --moe-layer-freq picks); and running a stack of them with full activation recompute.

Under sequence parallelism x is this rank's sequence shard: the norms and dropouts work on it, the attention and MLP
gather the sequence on entry and reduce-scatter it on exit.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy
from megalite.model.attention import SelfAttention
from megalite.model.mlp import MLP
from megalite.model.moe import MoELayer
from megalite.model.norms import norm
from megalite.tensor_parallel import TensorParallelRNG, recompute


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rng: TensorParallelRNG | None, sequence_parallel: bool = False,
                 kernels: KernelPolicy = DEFAULT_POLICY, layer_number: int = 0):
        super().__init__()
        self.input_norm = norm(cfg, sequence_parallel, kernels)
        self.self_attention = SelfAttention(cfg, rng, sequence_parallel, kernels)
        self.pre_mlp_norm = norm(cfg, sequence_parallel, kernels)
        # layer_number (global): whether --moe-layer-freq makes this an MoE layer
        moe = cfg.num_experts is not None and cfg.moe_layers()[layer_number]
        self.mlp = MoELayer(cfg, sequence_parallel, kernels, layer_number) if moe else MLP(cfg, sequence_parallel, kernels)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.rng = rng
        self.sequence_parallel = sequence_parallel

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # A residual stream whole on every TP rank draws from the default stream, equal across TP; split along the
        # sequence, each rank holds different tokens, which need their own masks: the per-TP-rank stream.
        split = self.sequence_parallel and self.training and self.dropout.p > 0
        with self.rng.fork() if split else contextlib.nullcontext():
            return self.dropout(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._dropout(self.self_attention(self.input_norm(x)))
        return x + self._dropout(self.mlp(self.pre_mlp_norm(x)))


def _run(layers: nn.ModuleList, hidden: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        hidden = layer(hidden)
    return hidden


def run_layers(layers: nn.ModuleList, hidden: torch.Tensor, cfg: ModelConfig,
               rng: TensorParallelRNG | None) -> torch.Tensor:
    """The layers in order. With full recompute (while training), Megatron's two methods: ``uniform`` keeps only the
    input of each group of ``recompute_num_layers`` layers and reruns the group in backward; ``block`` does so for
    each of the first ``recompute_num_layers`` layers alone and runs the others normally (memory left over after
    recomputing some layers is better spent not recomputing the rest)."""
    training = len(layers) > 0 and layers[0].training and torch.is_grad_enabled()
    if cfg.recompute_granularity != "full" or not training:
        return _run(layers, hidden)
    n = cfg.recompute_num_layers
    if cfg.recompute_method == "uniform":
        for start in range(0, len(layers), n):
            hidden = recompute(lambda x, group=layers[start:start + n]: _run(group, x), rng, hidden)
        return hidden
    for index, layer in enumerate(layers):
        hidden = recompute(layer, rng, hidden) if index < n else layer(hidden)
    return hidden
