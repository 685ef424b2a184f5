"""Multi-latent attention (DeepSeek-V2/V3; Megatron's MLASelfAttention, Hugging Face's DeepseekV3Attention).

Keys and values come from one compressed latent per token instead of per-head projections of the hidden state:

    c_kv, k_rope = split(x W_kv_down)             latent of --kv-lora-rank channels, one rotary key
    k_nope_i, v_i = split(norm(c_kv) W_kv_up_i)   per head i: --qk-head-dim key channels, --v-head-dim values
    k_i = [k_nope_i, rope(k_rope)]                the rotary part (--qk-pos-emb-head-dim) shared by every head
    q_i = [q_nope_i, rope(q_rope_i)] = (norm(x W_q_down) W_q_up)_i, or (x W_q)_i without --q-lora-rank

"Decoupled" rope: rotary embeddings cannot pass through the up-projection (generation would have to re-expand every
cached key at its new relative rotation), so position lives only in the separate rotary channels. The softmax scale
is 1/sqrt(qk + rope channels), times mscale^2 with yarn rope scaling and --mscale-all-dim (DeepSeek-V3's
0.1 mscale_all_dim ln factor + 1, squared: Megatron's and Hugging Face's), folded into q here so that every core of
megalite.model.attention (SDPA, the fused softmax, sinks, windows, context parallelism, the KV cache) is reused as
it is, each with its own 1/sqrt(d).

Tensor parallelism, as Megatron's: the down-projections (and the norms of their latents) are replicated and act on
the tokens the rank holds (under sequence parallelism its shard: their parameters are then flagged
``sequence_parallel``, so their partial gradients are summed over TP); the up-projections are column-parallel over
heads (each rank its heads' rows, gathering the latent along the sequence under sequence parallelism, as any
column-parallel linear gathers its input); the output projection row-parallel. The shared rotary key enters the
per-head part like the latent: all-gathered over the sequence (backward: reduce-scattered) under sequence
parallelism, else copied into the TP region (backward: all-reduced), since each rank's heads give part of its
gradient.

Context parallelism exchanges what megalite.model.context_parallel exchanges for any attention: the up-projected
per-head keys and values of the local tokens (p2p's ring, a2a's all-to-all by heads, allgather), the values
zero-padded to the keys' width where the comm type sends them stacked (p2p and allgather and a2a stack k with v), the
padding's output dropped. The latent (kv_lora_rank + rope channels a token: 576 for DeepSeek-V3, against
heads/TP x (192 + 128) = 40960/TP) would be far less to send, but each rank would then up-project every other
rank's latents (CP - 1 more up-projections per layer, and in backward the up-projection's gradient of latents it
does not own to send back), and a2a splits by heads, which a latent shared by all heads cannot be: not done here.

Generation's KV cache keeps the normalized latent and the rotated rotary key of every position, not per-head keys
and values; each step up-projects the cached latents (the weight-absorbed form, q W_uk^T against the latent
directly, is an inference-kernel optimization left out).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalite import parallel_state
from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy
from megalite.model.attention import SelfAttention
from megalite.model.context_parallel import SequenceShard
from megalite.model.kv_cache import LayerCache
from megalite.model.norms import norm
from megalite.model.rotary import RotaryEmbedding, rope_scaling
from megalite.tensor_parallel import (ColumnParallelLinear, DiscardedOutput, RowParallelLinear, TensorParallelRNG,
                                      all_gather_tensor_parallel, copy_to_tensor_parallel, mark_sequence_parallel,
                                      offloading, recompute)
from megalite.tensor_parallel.mappings import SEQUENCE_DIM
from megalite.tensor_parallel.partition import REPLICATED, mark, normal_init, zeros_init


def softmax_scale_factor(cfg: ModelConfig) -> float:
    """What multiplies the softmax's 1/sqrt(d): mscale^2 with yarn and --mscale-all-dim, else 1."""
    if not (cfg.use_rope_scaling and cfg.rope_scaling_type == "yarn" and cfg.mscale_all_dim):
        return 1.0
    factor = cfg.rope_scaling_factor
    mscale = 1.0 if factor <= 1 else 0.1 * cfg.mscale_all_dim * math.log(factor) + 1.0
    return mscale * mscale


class _ReplicatedLinear(nn.Linear):
    """A linear every TP rank holds whole (the down-projections), applied to the tokens the rank holds."""

    def __init__(self, input_size: int, output_size: int, *, init_std: float, bias: bool, sequence_parallel: bool):
        super().__init__(input_size, output_size, bias=bias)
        mark(self.weight, self.weight.shape, REPLICATED, normal_init(init_std))
        if bias:
            mark(self.bias, self.bias.shape, REPLICATED, zeros_init)
        if sequence_parallel:   # a sequence shard's partial gradients, summed over TP
            for param in self.parameters():
                mark_sequence_parallel(param)


class LatentAttention(SelfAttention):
    def __init__(self, cfg: ModelConfig, rng: TensorParallelRNG | None, sequence_parallel: bool = False,
                 kernels: KernelPolicy = DEFAULT_POLICY, window: Optional[int] = None):
        nn.Module.__init__(self)
        heads, rope, nope = cfg.num_attention_heads, cfg.qk_pos_emb_head_dim, cfg.qk_head_dim
        self._init_core(cfg, rng, kernels, window, nope + rope)
        self.nope, self.rope, self.v_head_dim, self.kv_rank = nope, rope, cfg.v_head_dim, cfg.kv_lora_rank
        self.sequence_parallel = sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1
        self.rotary = RotaryEmbedding(rope, cfg.rotary_base, kernels, rope_scaling(cfg))
        self.query_scale = softmax_scale_factor(cfg)
        std, bias = cfg.init_method_std, not cfg.disable_bias_linear
        down = dict(init_std=std, bias=bias, sequence_parallel=sequence_parallel)
        up = dict(init_std=std, bias=False, sequence_parallel=sequence_parallel)
        if cfg.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(cfg.hidden_size, heads * (nope + rope), **up)
        else:
            self.linear_q_down_proj = _ReplicatedLinear(cfg.hidden_size, cfg.q_lora_rank, **down)
            self.q_layernorm = _latent_norm(cfg, cfg.q_lora_rank, sequence_parallel, kernels)
            self.linear_q_up_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * (nope + rope), **up)
        self.linear_kv_down_proj = _ReplicatedLinear(cfg.hidden_size, cfg.kv_lora_rank + rope, **down)
        self.kv_layernorm = _latent_norm(cfg, cfg.kv_lora_rank, sequence_parallel, kernels)
        # Per head [k_nope_i; v_i] rows, heads in order (Hugging Face's kv_b_proj): a plain split gives whole heads.
        self.linear_kv_up_proj = ColumnParallelLinear(cfg.kv_lora_rank, heads * (nope + cfg.v_head_dim), **up)
        output_std = std / math.sqrt(2.0 * cfg.num_layers)   # Megatron's scaled init of outputs
        self.linear_proj = RowParallelLinear(heads * cfg.v_head_dim, cfg.hidden_size, bias=bias, init_std=output_std,
                                             sequence_parallel=sequence_parallel)
        self._init_sink(cfg)
        self.recompute_up_projections = "mla_up_proj" in cfg.recomputed_modules()   # --recompute-modules

    def forward(self, x: torch.Tensor, shard: SequenceShard | None = None,
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        """As :meth:`SelfAttention.forward`."""
        q = self.linear_q_proj(x) if hasattr(self, "linear_q_proj") else self.q_layernorm(self.linear_q_down_proj(x))
        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_layernorm(latent)
        # The per-head part below sees every token of the sample's (CP-local) sequence and its gradient of the
        # shared rotary key is this rank's heads' share: the sequence gathered (reduce-scattered back), or copied.
        k_rope = (all_gather_tensor_parallel(k_rope, SEQUENCE_DIM) if self.sequence_parallel
                  else copy_to_tensor_parallel(k_rope))
        training = self.training and torch.is_grad_enabled()
        if cache is None and training and self.recompute_up_projections:
            # --recompute-modules mla_up_proj: the per-head queries, keys and values are freed once the core has
            # run (it saved them) and recomputed from the latents when backward reaches the core's output.
            up = DiscardedOutput(lambda q, latent, k_rope: self._per_head(q, latent, k_rope, shard, None), self.rng)
            q, k, v = up.run(q, latent, k_rope)
            context = self._core_of(q, k, v, shard, None)
            up.discard(context)
        else:
            q, k, v = self._per_head(q, latent, k_rope, shard, cache)
            context = self._core_of(q, k, v, shard, cache)
        with offloading(self.offloader, "attn_proj", self.training):
            return self.linear_proj(context)

    def _per_head(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, shard: SequenceShard | None,
                  cache: Optional[LayerCache]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The up-projections and rope: this rank's heads' queries, keys and values [batch, heads, seq, d] from the
        query latent (or the queries themselves without --q-lora-rank), the kv latent and the shared rotary key."""
        if hasattr(self, "linear_q_up_proj"):
            q = self.linear_q_up_proj(q)
        batch, seq, _ = q.shape
        q = q.view(batch, seq, self.heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        k_rope = k_rope.unsqueeze(1)   # [batch, 1, seq, rope]: one rotary key for every head
        positions = None if shard is None else shard.moved_positions
        if positions is not None:
            q_rope, k_rope = self.rotary(q_rope, k_rope, positions, shard.length)
        else:
            q_rope, k_rope = self.rotary(q_rope, k_rope, offset=0 if cache is None else cache.offset)
        if cache is not None:   # the latent is cached, the per-head keys and values made from it each step
            latent, k_rope = cache.cache.store(cache.index, latent.unsqueeze(1), k_rope)
            latent = latent.squeeze(1)
        k, v = self._keys_and_values(latent, k_rope)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.query_scale != 1:
            q = q * self.query_scale
        return q, k, v

    def _core_of(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard | None,
                 cache: Optional[LayerCache]) -> torch.Tensor:
        """The attention core (recomputed with --recompute-modules core_attn), heads merged: [batch, seq, heads x v]."""
        sink = self._sink(q)
        with offloading(self.offloader, "core_attn", self.training):   # --offload-modules core_attn
            if cache is not None:
                return cache.attend_stored(q, k, v, self.window, sink)
            if self.recompute_core and self.training and torch.is_grad_enabled():
                inputs = (q, k, v) if sink is None else (q, k, v, sink)
                return recompute(lambda q, k, v, sink=None: self._attend(q, k, v, shard, sink), self.rng, *inputs)
            return self._attend(q, k, v, shard, sink)

    def _keys_and_values(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's heads' keys [batch, heads, seq, qk + rope] and values [batch, heads, seq, v] of the latent
        [batch, seq, rank] and the rotated rotary key [batch, 1, seq, rope]."""
        kv = self.linear_kv_up_proj(latent)
        batch, seq, _ = kv.shape
        kv = kv.view(batch, seq, self.heads, self.nope + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.heads, -1, -1)], dim=-1)
        return k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard | None,
                sink: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The core of megalite.model.attention; context parallelism exchanges k and v stacked, so v is zero-padded
        to k's width there and the padding's output dropped."""
        width = k.shape[-1]
        if shard is None or shard.cp == 1 or v.shape[-1] == width:
            return super()._attend(q, k, v, shard, sink)
        context = super()._attend(q, k, F.pad(v, (0, width - v.shape[-1])), shard, sink)
        return context.unflatten(-1, (self.heads, width))[..., :self.v_head_dim].flatten(-2)


def _latent_norm(cfg: ModelConfig, channels: int, sequence_parallel: bool, kernels: KernelPolicy) -> nn.Module:
    """The configured norm over a latent (replicated, as the layer norms)."""
    return norm(dataclasses.replace(cfg, hidden_size=channels), sequence_parallel, kernels)
