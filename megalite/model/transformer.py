"""A pre-norm transformer layer: x + Dropout(Attn(Norm(x))), then x + Dropout(MLP(Norm(x))) (the MLP a mixture of
experts in the layers --moe-layer-freq picks), with --sandwich-norm x + Dropout(Norm(Attn(Norm(x)))) and likewise for
the MLP (Gemma 2/3); and running a stack of them with full activation recompute.

Under sequence parallelism x is this rank's sequence shard: the norms and dropouts work on it, the attention and MLP
gather the sequence on entry and reduce-scatter it on exit.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy
from megalite.model.attention import SelfAttention
from megalite.model.context_parallel import SequenceShard
from megalite.model.kv_cache import KVCache, LayerCache
from megalite.model.latent_attention import LatentAttention
from megalite.model.mlp import MLP
from megalite.model.moe import MoELayer
from megalite.model.norms import norm
from megalite.tensor_parallel import ActivationOffloader, DiscardedOutput, TensorParallelRNG, offloading, recompute


class TransformerLayer(nn.Module):
    offloader: Optional[ActivationOffloader] = None   # --offload-modules attn_norm, mlp_norm: set by GPTModel

    def __init__(self, cfg: ModelConfig, rng: TensorParallelRNG | None, sequence_parallel: bool = False,
                 kernels: KernelPolicy = DEFAULT_POLICY, layer_number: int = 0):
        super().__init__()
        self.input_norm = norm(cfg, sequence_parallel, kernels)
        # Multi-token prediction's layers, numbered after the model's, are built like its last (Megatron's builder).
        kind = min(layer_number, cfg.num_layers - 1)
        window = None if cfg.window_size is None else cfg.attention_windows()[kind]   # --window-size
        attention = LatentAttention if cfg.multi_latent_attention else SelfAttention   # --multi-latent-attention
        self.self_attention = attention(cfg, rng, sequence_parallel, kernels, window)
        # --sandwich-norm: each sublayer's output normalized before its residual add
        self.post_attention_norm = norm(cfg, sequence_parallel, kernels) if cfg.sandwich_norm else None
        self.pre_mlp_norm = norm(cfg, sequence_parallel, kernels)
        # layer_number (global): whether --moe-layer-freq makes this an MoE layer
        moe = cfg.num_experts is not None and cfg.moe_layers()[kind]
        self.mlp = MoELayer(cfg, sequence_parallel, kernels, layer_number) if moe else MLP(cfg, sequence_parallel, kernels)
        self.post_mlp_norm = norm(cfg, sequence_parallel, kernels) if cfg.sandwich_norm else None
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.rng = rng
        self.sequence_parallel = sequence_parallel
        modules = cfg.recomputed_modules()   # --recompute-modules (selective): the norms, a dense MLP, an MoE layer
        self.recompute_norms = "layernorm" in modules
        self.recompute_mlp = "moe" in modules if moe else "mlp" in modules

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # A residual stream whole on every TP rank draws from the default stream, equal across TP; split along the
        # sequence, each rank holds different tokens, which need their own masks: the per-TP-rank stream.
        split = self.sequence_parallel and self.training and self.dropout.p > 0
        with self.rng.fork() if split else contextlib.nullcontext():
            return self.dropout(x)

    def forward(self, x: torch.Tensor, shard: SequenceShard | None = None,
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()) or not (self.recompute_norms or self.recompute_mlp):
            x = x + self._dropout(self._sandwich(self.post_attention_norm,
                                                 self.self_attention(self._norm("attn_norm", x), shard, cache)))
            return x + self._dropout(self._sandwich(self.post_mlp_norm, self.mlp(self._norm("mlp_norm", x))))
        attention = self._after_norm("attn_norm", lambda h: self.self_attention(h, shard), x)
        x = x + self._dropout(self._sandwich(self.post_attention_norm, attention))
        mlp = (lambda h: recompute(self.mlp, self.rng, h)) if self.recompute_mlp else self.mlp
        return x + self._dropout(self._sandwich(self.post_mlp_norm, self._after_norm("mlp_norm", mlp, x)))

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The input (attn_norm) or pre-MLP (mlp_norm) norm of ``x``, offloading what it saves if so chosen."""
        with offloading(self.offloader, name, self.training):   # --offload-modules attn_norm, mlp_norm
            return (self.input_norm if name == "attn_norm" else self.pre_mlp_norm)(x)

    @staticmethod
    def _sandwich(post_norm: Optional[nn.Module], out: torch.Tensor) -> torch.Tensor:
        """--sandwich-norm: a sublayer's output normalized before its residual add."""
        return out if post_norm is None else post_norm(out)

    def _after_norm(self, name: str, consumer, x: torch.Tensor) -> torch.Tensor:
        """``consumer(norm(x))`` (``name``: attn_norm or mlp_norm), the norm's output freed once the consumer has run
        (--recompute-modules layernorm): recomputed when backward reaches the consumer's output."""
        if not self.recompute_norms:
            return consumer(self._norm(name, x))
        normed = DiscardedOutput(self.input_norm if name == "attn_norm" else self.pre_mlp_norm, self.rng)
        with offloading(self.offloader, name, self.training):   # what the rerun needs: x
            normed_x = normed.run(x)
        out = consumer(normed_x)
        normed.discard(out)
        return out


def _run(layers: nn.ModuleList, hidden: torch.Tensor, shard: SequenceShard | None) -> torch.Tensor:
    for layer in layers:
        hidden = layer(hidden, shard)
    return hidden


def run_layers(layers: nn.ModuleList, hidden: torch.Tensor, cfg: ModelConfig, rng: TensorParallelRNG | None,
               shard: SequenceShard | None = None, cache: Optional[KVCache] = None,
               layer_offset: int = 0) -> torch.Tensor:
    """The layers in order (with a ``cache``, each with its slot, numbered from ``layer_offset``). With full
    recompute (while training), Megatron's two methods: ``uniform`` keeps only the input of each group of
    ``recompute_num_layers`` layers and reruns the group in backward; ``block`` does so for each of the first
    ``recompute_num_layers`` layers alone and runs the others normally (memory left over after recomputing some
    layers is better spent not recomputing the rest)."""
    if cache is not None:
        for index, layer in enumerate(layers):
            hidden = layer(hidden, shard, cache.layer(layer_offset + index))
        return hidden
    training = len(layers) > 0 and layers[0].training and torch.is_grad_enabled()
    if cfg.recompute_granularity != "full" or not training:
        return _run(layers, hidden, shard)
    n = cfg.recompute_num_layers
    if cfg.recompute_method == "uniform":
        for start in range(0, len(layers), n):
            hidden = recompute(lambda x, group=layers[start:start + n]: _run(group, x, shard), rng, hidden)
        return hidden
    for index, layer in enumerate(layers):
        hidden = recompute(lambda x, layer=layer: layer(x, shard), rng, hidden) if index < n else layer(hidden, shard)
    return hidden
