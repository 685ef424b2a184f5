"""Causal self-attention with heads split over tensor-parallel ranks; multi-head or grouped-query.

One column-parallel projection makes q, k and v together. Its weight is the stack [Wq; Wk; Wv] (Hugging Face's
q_proj, k_proj, v_proj one above the other), each block split over TP separately, so a rank gets the q of its query
heads and the k and v of the key/value heads they use. With grouped-query attention (G key/value heads, G < heads)
the blocks are unequal: [heads x head_dim; G x head_dim; G x head_dim]. The head dimension is hidden / heads unless
``--kv-channels`` sets it (Qwen3, Gemma): q and the projection's input are then heads x head_dim wide.

- G >= TP (G divisible by TP): each rank holds G/TP whole key/value heads, those of its query heads.
- G < TP (TP divisible by G): a key/value head serves the query heads of TP/G ranks. Each of them computes 1/(TP/G)
  of that head's channels (the weights stay split evenly, nothing is replicated) and they all-gather the pieces, over
  those TP/G ranks only (a subgroup of TP, megalite.parallel_state); the gather's backward reduce-scatters, which sums
  the gradient each rank's query heads send to the shared head.

With ``--qk-layernorm`` each head's query and key are normalized (Qwen3's q_norm/k_norm) before rotary embeddings,
when configured, rotate q and k; attention runs on this rank's heads through torch's
scaled_dot_product_attention (the "core", which selective recompute reruns in backward instead of keeping its
seq x seq intermediates); a row-parallel projection sums the heads' contributions back into the residual stream.
With a KV cache (generation) the new tokens are rotated at their positions and attend to the cached keys and values
too (megalite.model.kv_cache). ``--add-qkv-bias`` gives the q/k/v projection a bias under ``--disable-bias-linear``.

With ``--use-fused-kernels on`` (and not ``--no-masked-softmax-fusion``) the core on CUDA is instead Megatron's
unfused attention with the fused causal softmax: q k^T, the scaled upper-triangular masked softmax kernel, dropout,
times v. It materializes the seq x seq probabilities, so ``auto`` keeps SDPA (see megalite.kernels.policy).

A :class:`~megalite.model.context_parallel.SequenceShard` says which tokens of the sample the input holds: their
positions rotate q and k, packed documents mask the core (SDPA with a block-diagonal causal mask; the fused softmax
knows the causal mask only), and under context parallelism the core attends over the other ranks' tokens too
(megalite.model.context_parallel).

A layer with a sliding window (``--window-size LEFT,0``, in the layers ``--window-attn-skip-freq`` leaves windowed)
lets each query attend to itself and the LEFT tokens before it only: SDPA with a banded causal mask (and packed
documents' mask), where the sequence is longer than the window; a window covering the sequence keeps the causal fast
path. Context parallelism refuses a window (megalite.config.validate). With ``--local-rotary-base`` the windowed layers
rotate q and k with that base and no rope scaling, the global ones with ``--rotary-base`` and the scaling (Gemma 3).

``--softmax-scale`` replaces 1/sqrt(head dim) as the factor of q k^T in every core: SDPA's ``scale``, the fused
softmax's, the sink core's, the KV cache's and context-parallel ring attention's (Gemma 3's query_pre_attn_scalar^-0.5).

With ``--softmax-type off-by-one`` or ``learnable`` each head's softmax has a sink logit besides the keys' scores (0,
or the learnable per-head ``softmax_offset``, split over TP with the heads): the core is then the explicit softmax
of megalite.model.sinks, whatever the kernel policy, with the causal (or windowed, or documents') mask, and so is the
KV cache's. Context parallelism refuses a sink (megalite.config.validate).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalite import parallel_state
from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy
from megalite.kernels.fused import scaled_masked_softmax
from megalite.kernels.policy import MASKED_SOFTMAX
from megalite.model.context_parallel import SequenceShard, context_parallel_attention
from megalite.model.kv_cache import LayerCache, causal_mask
from megalite.model.norms import norm
from megalite.model.rotary import RotaryEmbedding, rope_scaling
from megalite.model.sinks import sink_attention
from megalite.tensor_parallel import (ColumnParallelLinear, Fp8Recipe, RowParallelLinear, TensorParallelRNG,
                                      ActivationOffloader, all_gather_over, mark_sequence_parallel, offloading,
                                      recompute)
from megalite.tensor_parallel.partition import Partition, mark, normal_init


def _head_norm(cfg: ModelConfig, kernels: KernelPolicy) -> nn.Module:
    """A per-head query or key norm (--qk-layernorm). Each TP rank applies it to its own heads, so its gradient is a
    partial sum over the heads of the rank: flagged like a sequence-parallel parameter, to be summed over TP."""
    module = norm(dataclasses.replace(cfg, hidden_size=cfg.head_dim), False, kernels)
    for param in module.parameters():
        mark_sequence_parallel(param)
    return module


class SelfAttention(nn.Module):
    offloader: Optional[ActivationOffloader] = None   # --offload-modules core_attn, attn_proj: set by GPTModel

    def __init__(self, cfg: ModelConfig, rng: TensorParallelRNG | None, sequence_parallel: bool = False,
                 kernels: KernelPolicy = DEFAULT_POLICY, window: Optional[int] = None):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        heads, groups, head_dim = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
        self._init_core(cfg, rng, kernels, window, head_dim)
        self.kv_heads = max(groups // tp, 1)              # key/value heads used on this rank
        self.kv_channels = groups * head_dim // tp         # k (and v) channels this rank computes
        self.sharing_ranks = max(tp // groups, 1)          # ranks computing pieces of one key/value head
        # --local-rotary-base: a windowed layer rotates with its own base, unscaled (Gemma 3's local layers)
        local = window is not None and cfg.local_rotary_base is not None
        self.rotary = (RotaryEmbedding(cfg.rotary_dim, cfg.local_rotary_base if local else cfg.rotary_base, kernels,
                                       None if local else rope_scaling(cfg))
                       if cfg.position_embedding_type == "rope" else None)
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:   # one norm over the head dimension, shared by every head
            self.q_layernorm, self.k_layernorm = (_head_norm(cfg, kernels) for _ in range(2))
        bias = not cfg.disable_bias_linear
        kv_size = groups * head_dim
        # Queries are heads x head_dim wide: the hidden size, unless --kv-channels sets another head dimension.
        fused = 3 if groups == heads else (cfg.query_size, kv_size, kv_size)
        output_std = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)   # Megatron's scaled init of outputs
        fp8 = Fp8Recipe.of(cfg)   # --fp8-format: both projections' products in FP8 (the core stays bf16)
        self.linear_qkv = ColumnParallelLinear(cfg.hidden_size, cfg.query_size + 2 * kv_size, fused=fused,
                                               bias=bias or cfg.add_qkv_bias, init_std=cfg.init_method_std,
                                               sequence_parallel=sequence_parallel, fp8=fp8)
        self.linear_qkv.weight.is_qkv = True   # blocks [q; k; v], which Muon orthogonalizes one by one
        self.linear_proj = RowParallelLinear(cfg.query_size, cfg.hidden_size, bias=bias, init_std=output_std,
                                             sequence_parallel=sequence_parallel, fp8=fp8)
        self._init_sink(cfg)

    def _init_core(self, cfg: ModelConfig, rng: TensorParallelRNG | None, kernels: KernelPolicy,
                   window: Optional[int], head_dim: int) -> None:
        """What the attention core needs (shared with megalite.model.latent_attention): this rank's heads, the
        queries' and keys' ``head_dim`` (the fused softmax's scale 1/sqrt(head_dim)), dropout, recompute, window."""
        self.kernels = kernels
        self.window = window   # tokens before a query it attends to besides itself; None: all of them
        self.heads = cfg.num_attention_heads // parallel_state.get_tensor_model_parallel_world_size()
        self.head_dim = head_dim
        self.dropout = cfg.attention_dropout
        self.rng = rng
        self.recompute_core = "core_attn" in cfg.recomputed_modules()
        self.scale = cfg.softmax_scale   # of q k^T; None: SDPA's 1/sqrt(head dim)

    def _init_sink(self, cfg: ModelConfig) -> None:
        self.softmax_type = cfg.softmax_type
        if cfg.softmax_type == "learnable":   # one sink logit per head, drawn as Megatron does (its init_method)
            self.softmax_offset = mark(nn.Parameter(torch.empty(self.heads)), (cfg.num_attention_heads,),
                                       Partition(dim=0), normal_init(cfg.init_method_std))

    def _sink(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's heads' sink logits [heads]: None for the vanilla softmax, zeros for off-by-one."""
        if self.softmax_type == "vanilla":
            return None
        return self.softmax_offset if self.softmax_type == "learnable" else like.new_zeros(self.heads)

    def forward(self, x: torch.Tensor, shard: SequenceShard | None = None,
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        """With a ``cache`` (generation, one process), ``x`` holds the tokens after the cached ones, which it attends
        to too; with a ``shard`` (context parallelism, packed documents), the positions and mask it describes."""
        qkv = self.linear_qkv(x)                 # the whole (local) sequence, also under sequence parallelism
        batch, seq, _ = qkv.shape
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_channels, self.kv_channels], dim=-1)
        if self.sharing_ranks > 1:
            k, v = self._gather_shared_head(k, v)
        q = q.view(batch, seq, self.heads, self.head_dim)
        k, v = (t.view(batch, seq, self.kv_heads, self.head_dim) for t in (k, v))
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.rotary is not None:
            positions = None if shard is None else shard.moved_positions
            if positions is not None:
                q, k = self.rotary(q, k, positions, shard.length)
            else:
                q, k = self.rotary(q, k, offset=0 if cache is None else cache.offset)
        sink = self._sink(q)
        with offloading(self.offloader, "core_attn", self.training):
            if cache is not None:
                context = cache.attend(q, k, v, self.window, sink, self.scale)
            elif self.recompute_core and self.training and torch.is_grad_enabled():
                # The sink is an input too, so that its gradient leaves the recomputed core like q's, k's and v's.
                inputs = (q, k, v) if sink is None else (q, k, v, sink)
                context = recompute(lambda q, k, v, sink=None: self._attend(q, k, v, shard, sink), self.rng,
                                    *inputs)
            else:
                context = self._attend(q, k, v, shard, sink)
        with offloading(self.offloader, "attn_proj", self.training):
            return self.linear_proj(context)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard | None,
                sink: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention core over the sample (the recomputed part), with the heads' ``sink`` logits if any: heads
        merged back, [batch, seq, heads x d]."""
        if shard is not None and shard.cp > 1:
            context = context_parallel_attention(q, k, v, shard, self._core, self.scale, self.window)
        else:
            mask = None if shard is None else shard.whole_sequence_mask()
            seq = q.shape[-2]
            if (self.window is not None and seq > self.window + 1) or (sink is not None and mask is None):
                band = causal_mask(seq, seq, self.window, q.device)   # the sink core is told the causal mask
                mask = band if mask is None else mask & band
            if sink is not None:
                dropout = self.dropout if self.training else 0.0
                with self.rng.fork() if dropout > 0 else contextlib.nullcontext():
                    context = sink_attention(q, k, v, sink, mask, dropout, self.scale)
            else:
                context = self._core(q, k, v, mask)
        batch, _, seq, _ = context.shape
        return context.transpose(1, 2).reshape(batch, seq, -1)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + mask) with dropout, times v: [batch, heads, seq, d] (--softmax-scale in place of
        1 / sqrt(d)). ``mask`` (boolean, True where allowed) defaults to causal."""
        dropout = self.dropout if self.training else 0.0
        ops = self.kernels.ops(MASKED_SOFTMAX, q) if mask is None else None
        # Attention probabilities belong to this rank's heads: their dropout draws from the per-TP-rank stream.
        with self.rng.fork() if dropout > 0 else contextlib.nullcontext():
            if ops is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                      is_causal=mask is None, scale=self.scale,
                                                      enable_gqa=k.shape[1] != q.shape[1])
            return self._fused_softmax_core(q, k, v, dropout, ops)

    def _fused_softmax_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
                            ops) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal mask) v with the fused masked softmax: [batch, heads, seq, d]."""
        if k.shape[1] != q.shape[1]:   # query head i uses key/value head i // (heads / kv_heads), as SDPA's GQA
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale
        probs = scaled_masked_softmax(q @ k.transpose(-2, -1), scale, ops)
        return F.dropout(probs, dropout) @ v if dropout > 0 else probs @ v

    def _gather_shared_head(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Assemble this rank's key/value head from the channel pieces of the ranks sharing it."""
        batch, seq, channels = k.shape
        # Over the TP / G ranks sharing the head only (a subgroup of TP): rank-major [k_0 v_0 k_1 v_1 ...].
        sharing = parallel_state.get_tensor_model_parallel_subgroup(self.sharing_ranks)
        pieces = all_gather_over(torch.cat([k, v], dim=-1), -1, sharing)
        pieces = pieces.view(batch, seq, self.sharing_ranks, 2, channels)
        k, v = pieces.transpose(2, 3).reshape(batch, seq, 2, self.sharing_ranks * channels).unbind(2)
        return k, v
