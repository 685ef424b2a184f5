"""Multi-token prediction (DeepSeek-V3, section 2.2; Megatron's ``--mtp-num-layers``): D sequential modules after the
last layer, on the last pipeline stage. Module k (1-based) takes, at each position i, the previous depth's hidden state
(depth 0: the model's, after its final norm, as Megatron hands it over) and the embedding of the token k places
ahead, normalizes each (``hnorm``, ``enorm``), projects their concatenation [embedding; hidden] back to the hidden size
(``eh_proj``), runs one transformer layer (built like the model's last one: dense or MoE, its window) and its own final
norm; the model's output layer turns that into logits for the token k + 1 places ahead. The embedding and the output
layer are the model's (on a last stage without the embedding, a copy tied to it like a tied output layer).

The shifted tokens, labels and loss masks of every depth are cut here from the whole sample, which every rank holds,
before context parallelism takes its share (:func:`multi_token_targets`): Megatron's ranks hold only their CP chunks
and roll them with a send and receive between neighbouring CP ranks; here no communication is needed, and the result
is the same. Depth k has no label for the last k positions of a sample (Megatron's roll fills them with zeros and
masks their loss); with packed documents whose attention is reset (``--reset-attention-mask``) a position also has none
where the token k places ahead lies in another document (Megatron's rule for packed sequences, which rolls each one
alone), and ``--eod-mask-loss`` masks depth k at i where it masks the model's loss at i + k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy
from megalite.model.context_parallel import SequenceShard
from megalite.model.norms import norm
from megalite.model.transformer import TransformerLayer, run_layers
from megalite.tensor_parallel import (ColumnParallelLinear, TensorParallelRNG, gather_from_tensor_parallel,
                                      scatter_to_tensor_parallel)

_SEQUENCE = 1   # hidden states are [batch, sequence, hidden]


@dataclass(frozen=True)
class MultiTokenTargets:
    """Per depth k = 1..D (the leading dimension), this rank's tokens of the samples: the token k places ahead of each
    (embedded by module k), the token k + 1 places ahead (its label) and whether that counts in the loss."""
    tokens: torch.Tensor      # [depth, batch, local]
    labels: torch.Tensor      # [depth, batch, local]
    loss_mask: torch.Tensor   # [depth, batch, local], fp32


def multi_token_targets(samples: torch.Tensor, depth: int, loss_mask: torch.Tensor, documents: Optional[torch.Tensor],
                        shard: SequenceShard) -> MultiTokenTargets:
    """The targets of ``depth`` modules from whole samples [batch, seq + 1], the model's loss mask [batch, seq] and the
    document of each input token [batch, seq] (None: attention is not reset per document)."""
    seq = samples.shape[1] - 1
    tokens, labels, masks = [], [], []
    for k in range(1, depth + 1):
        valid = torch.zeros(samples.shape[0], seq, dtype=torch.bool, device=samples.device)
        valid[:, :seq - k] = True if documents is None else documents[:, k:] == documents[:, :seq - k]
        ahead = lambda x: F.pad(x, (0, k)).masked_fill(~valid, 0)   # noqa: E731 - x[i + k] at i, 0 where not valid
        tokens.append(shard.take(ahead(samples[:, k:seq])))
        labels.append(shard.take(ahead(samples[:, k + 1:])))
        masks.append(shard.take(ahead(loss_mask[:, k:])))
    return MultiTokenTargets(torch.stack(tokens), torch.stack(labels), torch.stack(masks))


class MultiTokenPredictionModule(nn.Module):
    """Depth k's module: [enorm(embedding); hnorm(hidden)] -> eh_proj -> transformer layer -> final norm."""

    def __init__(self, cfg: ModelConfig, rng: TensorParallelRNG | None, sequence_parallel: bool,
                 kernels: KernelPolicy, layer_number: int):
        super().__init__()
        self.cfg, self.rng, self.sequence_parallel = cfg, rng, sequence_parallel
        self.enorm = norm(cfg, sequence_parallel, kernels)
        self.hnorm = norm(cfg, sequence_parallel, kernels)
        # Column-parallel as Megatron's: each TP rank computes a slice of the hidden size, then gathers it.
        self.eh_proj = ColumnParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, bias=False,
                                            init_std=cfg.init_method_std, sequence_parallel=sequence_parallel)
        self.transformer_layer = TransformerLayer(cfg, rng, sequence_parallel, kernels, layer_number)
        self.final_norm = norm(cfg, sequence_parallel, kernels)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, shard: SequenceShard | None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        # Gathered over TP (backward keeps this rank's slice: the layer's input gradient is whole on every rank);
        # under sequence parallelism the projection gathered the sequence, and this rank keeps its shard again.
        x = gather_from_tensor_parallel(x)
        if self.sequence_parallel:
            x = scatter_to_tensor_parallel(x, _SEQUENCE)
        # One layer, run_layers for the recompute options (a group of one layer under either method).
        x = run_layers(nn.ModuleList([self.transformer_layer]), x, self.cfg, self.rng, shard)
        return self.final_norm(x)


class MultiTokenPrediction(nn.Module):
    """The D modules in order; their transformer layers are numbered after the model's (global numbering)."""

    def __init__(self, cfg: ModelConfig, rng: TensorParallelRNG | None, sequence_parallel: bool = False,
                 kernels: KernelPolicy = DEFAULT_POLICY):
        super().__init__()
        self.layers = nn.ModuleList(MultiTokenPredictionModule(cfg, rng, sequence_parallel, kernels,
                                                               cfg.num_layers + k)
                                    for k in range(cfg.mtp_num_layers))

    def forward(self, hidden: torch.Tensor, targets: MultiTokenTargets, shard: SequenceShard | None,
                embed: Callable[[torch.Tensor], torch.Tensor],
                loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Per-token losses [depth, batch, local] (unmasked) from the model's final hidden states ``hidden``;
        ``embed`` is the model's embedding of tokens, ``loss`` its output layer and cross-entropy."""
        losses = []
        for module, tokens, labels in zip(self.layers, targets.tokens, targets.labels):
            hidden = module(hidden, embed(tokens), shard)
            losses.append(loss(hidden, labels))
        return torch.stack(losses)
