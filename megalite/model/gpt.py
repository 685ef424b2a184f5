"""GPT: embeddings, a stack of transformer layers, a final norm, and a vocab-parallel output layer and loss.

The architecture follows the config: GPT-2 (learned positions, LayerNorm, GeLU, biases) or Llama-style (rotary
positions, RMSNorm, SwiGLU, grouped-query attention, no biases), in any combination. Under sequence parallelism the
hidden states between the embedding and the output layer are this rank's sequence shard [batch, seq / TP, hidden]
(that is also what pipeline stages send each other); the output layer gathers the sequence back.

A ``GPTModel`` may hold only part of the stack (a pipeline stage): ``layer_offset`` is the global index of its first
layer, and ``pre_process``/``post_process`` say whether it holds the embeddings / the output layer. Parameter names
used for initialization (and by checkpoints) are *canonical*: layers are numbered globally, so a parameter has the
same name and the same initial value whatever the layout.

With the output layer tied to the word embedding and the two on different pipeline stages, the last stage holds a
copy of the embedding weight: named ``embedding.word.weight`` canonically, so it starts with the same values, and
flagged ``is_embedding_copy`` so its gradient is summed with the original's and the norm counts it once. Multi-token
prediction (megalite.model.multi_token_prediction, on the last stage) embeds tokens there: a last stage without the
embedding then holds a copy of the whole embedding module, tied the same way (and a tied output layer uses it).

``kernels`` (a :class:`~megalite.kernels.KernelPolicy`, from ``--use-fused-kernels`` and the per-op switches, resolved
by ``megalite.kernels.prepare``) says which ops run as fused CUDA kernels on GPU tensors; on CPU tensors every op is
the plain torch one whatever it says.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
from typing import Iterator

import torch
from torch import nn

from megalite import parallel_state
from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy
from megalite.model.context_parallel import SequenceShard
from megalite.model.kv_cache import KVCache
from megalite.model.multi_token_prediction import MultiTokenPrediction, MultiTokenTargets
from megalite.model.norms import norm, position_embedding
from megalite.model.transformer import TransformerLayer, run_layers
from megalite.tensor_parallel import (ActivationOffloader, ColumnParallelLinear, Fp8History, TensorParallelRNG,
                                      VocabParallelEmbedding, fp8_histories, gather_from_tensor_parallel,
                                      initialize_parameters, mark_sequence_parallel, vocab_parallel_cross_entropy)


@functools.lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as transformers' Gemma multiplies by it: an fp32 tensor cast to the embeddings' dtype (a Python
    number, so no tensor is made on the device each step)."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


class GPTEmbedding(nn.Module):
    """Word embeddings (split over TP by vocabulary), times sqrt(hidden size) with --scale-embeddings, plus learned
    absolute positions unless the model uses rotary ones, then dropout. Under sequence parallelism each rank gets,
    and adds positions to, its sequence shard only."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int, rng: TensorParallelRNG | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.word = VocabParallelEmbedding(cfg.vocab_size, padded_vocab_size, cfg.hidden_size,
                                           init_std=cfg.init_method_std, sequence_parallel=sequence_parallel)
        self.position = None
        if cfg.learned_positions:
            self.position = position_embedding(cfg.max_positions, cfg.hidden_size, cfg.init_method_std)
            if sequence_parallel:
                mark_sequence_parallel(self.position.weight)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.rng, self.sequence_parallel = rng, sequence_parallel
        self.scale = cfg.hidden_size ** 0.5 if cfg.scale_embeddings else None   # Gemma's normalizer

    def forward(self, tokens: torch.Tensor, shard: SequenceShard | None = None,
                first_position: int = 0) -> torch.Tensor:
        embeddings = self.word(tokens)
        if self.scale is not None:
            embeddings = embeddings * _rounded(self.scale, embeddings.dtype)
        split = self.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1
        if self.position is not None:
            local = embeddings.shape[1]
            first = first_position + (parallel_state.get_tensor_model_parallel_rank() * local if split else 0)
            positions = None if shard is None else shard.moved_positions
            if positions is None:
                positions = torch.arange(first, first + local, device=tokens.device)
            else:   # this rank's tokens' own positions (of its sequence-parallel shard)
                positions = positions[..., first:first + local]
            embeddings = embeddings + self.position(positions)
        # Split along the sequence, each TP rank holds different tokens: their dropout draws from the per-rank stream.
        with self.rng.fork() if split and self.training and self.dropout.p > 0 else contextlib.nullcontext():
            return self.dropout(embeddings)


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rng: TensorParallelRNG | None = None, *, pre_process: bool = True,
                 post_process: bool = True, layer_offset: int = 0, num_layers: int | None = None,
                 sequence_parallel: bool = False, kernels: KernelPolicy = DEFAULT_POLICY):
        super().__init__()
        self.kernels = kernels
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.cfg, self.rng = cfg, rng
        self.padded_vocab_size = cfg.padded_vocab_size(tp)
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset = layer_offset
        self.tie_output_to_embedding = not cfg.untie_embeddings_and_output_weights
        mtp = post_process and cfg.mtp_num_layers is not None
        # Tied, or embedding tokens for multi-token prediction: the last stage needs the embedding (a copy, if not
        # the first stage too).
        self.ties_embedding = self.tie_output_to_embedding or cfg.mtp_num_layers is not None
        self.embedding = (GPTEmbedding(cfg, self.padded_vocab_size, rng, sequence_parallel) if pre_process or mtp
                          else None)
        count = cfg.num_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(TransformerLayer(cfg, rng, sequence_parallel, kernels, layer_offset + i)
                                    for i in range(count))
        # Tied and on a stage with the embedding: reuse its weight. Tied on another stage: hold a copy.
        self.holds_embedding_copy = post_process and self.ties_embedding and not pre_process
        self.mtp = MultiTokenPrediction(cfg, rng, sequence_parallel, kernels) if mtp else None
        if post_process:
            self.final_norm = norm(cfg, sequence_parallel, kernels)
            self.output_layer = ColumnParallelLinear(
                cfg.hidden_size, cfg.vocab_size, bias=False, init_std=cfg.init_method_std,
                padded_output_size=self.padded_vocab_size,
                weight_from_caller=self.tie_output_to_embedding and self.embedding is not None,
                sequence_parallel=sequence_parallel)
            if self.holds_embedding_copy:
                self._embedding_copy().is_embedding_copy = True
        # --offload-modules: one offloader per model chunk (a forward is one chain of groups to prefetch along),
        # handed to the layers' parts that offload (their ``offloader`` attribute).
        offloaded = cfg.offloaded_modules()
        self.offloader = ActivationOffloader(offloaded) if offloaded else None
        for module in self.modules() if self.offloader is not None else ():
            if module is not self and hasattr(module, "offloader"):
                module.offloader = self.offloader
        # What --decoupled-lr steps at its own rate (Megatron's is_embedding_or_output_parameter).
        for module in (self.embedding.word if self.embedding is not None else None,
                       self.output_layer if post_process else None):
            if module is not None and module.weight is not None:
                module.weight.is_embedding_or_output = True

    def _canonical(self, name: str) -> str:
        """``layers.1.mlp...`` of the stage that starts at layer 6 is ``layers.7.mlp...``."""
        match = re.match(r"layers\.(\d+)\.(.*)", name)
        return f"layers.{int(match.group(1)) + self.layer_offset}.{match.group(2)}" if match else name

    def canonical_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters with layers numbered globally (``layers.7.mlp...`` on the stage that starts at layer 6), then
        the buffers marked like parameters (state that is initialized and checkpointed but not stepped by the
        optimizer: the MoE routers' expert biases)."""
        buffers = ((name, b) for name, b in self.named_buffers() if hasattr(b, "full_shape"))
        for name, param in itertools.chain(self.named_parameters(), buffers):
            if name == "output_layer.weight" and self.holds_embedding_copy and self.embedding is None:
                name = "embedding.word.weight"
            yield self._canonical(name), param

    def canonical_fp8_histories(self) -> list[tuple[str, Fp8History]]:
        """The FP8 linears' amax histories (delayed recipe), named by their canonical module names."""
        return [(self._canonical(name), history) for name, history in fp8_histories([self])]

    def initialize(self, seed: int) -> None:
        """Layout-independent initialization: see megalite.tensor_parallel.partition."""
        initialize_parameters(self.canonical_named_parameters(), seed,
                              parallel_state.get_tensor_model_parallel_rank(),
                              parallel_state.get_tensor_model_parallel_world_size())

    def output_weight(self) -> torch.Tensor:
        return self.embedding.word.weight if self.output_layer.weight is None else self.output_layer.weight

    def _embedding_copy(self) -> torch.nn.Parameter:
        """The last stage's copy of the word embedding: its embedding's (multi-token prediction), else the output
        layer's."""
        return self.embedding.word.weight if self.embedding is not None else self.output_layer.weight

    def tied_embedding_weights(self) -> list[torch.nn.Parameter]:
        """This chunk's copies of the tied word embedding that must agree with the other stage's."""
        if not self.ties_embedding:
            return []
        if self.pre_process:
            return [self.embedding.word.weight]
        return [self._embedding_copy()] if self.post_process else []

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                shard: SequenceShard | None = None, cache: KVCache | None = None,
                mtp: MultiTokenTargets | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-token loss [batch, seq] when ``labels`` are given, else this rank's vocabulary slice of the logits;
        with multi-token prediction's targets ``mtp`` (the last stage, training) also its per-token losses
        [depth, batch, seq], unmasked: (loss, MTP losses).
        A chunk without the embedding takes the previous stage's hidden states as ``tokens``; one without the
        output layer returns its hidden states. ``shard`` (megalite.model.context_parallel) says which tokens of
        the samples these are and which documents they belong to; without one, tokens 0, 1, ... of one document
        each (which context parallelism cannot do without). With a ``cache`` (generation, one process), ``tokens``
        continue the cached ones and are added to it."""
        if shard is None and parallel_state.get_context_parallel_world_size() > 1:
            raise ValueError("under context parallelism the model needs the SequenceShard of its tokens")
        first_position = 0 if cache is None else cache.length
        if self.offloader is not None:
            self.offloader.begin_forward()
        hidden = self.embedding(tokens, shard, first_position) if self.pre_process else tokens
        hidden = run_layers(self.layers, hidden, self.cfg, self.rng, shard, cache, self.layer_offset)
        if cache is not None:
            cache.advance(tokens.shape[1])
        if not self.post_process:
            return hidden
        hidden = self.final_norm(hidden)
        logits = self.output_layer(hidden, self.output_weight())
        if labels is None:
            return logits
        loss = vocab_parallel_cross_entropy(logits, labels, self.cfg.vocab_size, self.kernels)
        if mtp is None:
            return loss
        return loss, self.mtp(hidden, mtp, shard, lambda ids: self.embedding(ids, shard), self._loss)

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy of the output layer's logits of (normalized) hidden states."""
        return vocab_parallel_cross_entropy(self.output_layer(hidden, self.output_weight()), labels,
                                            self.cfg.vocab_size, self.kernels)

    def full_logits(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits over the whole, unpadded vocabulary (gathered over TP): for evaluation, generation and tests."""
        return gather_from_tensor_parallel(self(tokens, cache=cache))[..., : self.cfg.vocab_size]
