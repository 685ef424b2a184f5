"""The mixture-of-experts layer, in place of a transformer layer's MLP (``--num-experts``, ``--moe-layer-freq``).

    y = sum over the token's k chosen experts e of  weight_e x expert_e(x)   (+ the shared expert's output)

The router (megalite.model.router) chooses the experts and weights and attaches the balancing losses; the dispatcher
(megalite.model.dispatcher) brings each token to the expert-parallel rank holding each of its experts and back; the
experts (megalite.model.experts) are this rank's E / EP MLPs. A shared expert (``--moe-shared-expert-intermediate-
size``) is an ordinary tensor-parallel MLP every token goes through, optionally scaled by sigmoid(x w) (Qwen2-MoE's
shared expert gate).

With tensor parallelism every TP rank routes the same tokens (the whole sequence: under sequence parallelism the
layer all-gathers it first, like the MLP's first linear, and keeps its own shard of the output at the end), so the
router, its losses and the dispatch are identical on the TP ranks and the router's gradient needs no sum over TP;
the experts are split over TP as the dense MLP is and their partial outputs are summed once, before the routing
weights apply. Expert-parallel groups join ranks of equal TP rank, so each TP slice of the experts talks only to its
peers.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from megalite import parallel_state
from megalite.config import ModelConfig
from megalite.kernels import DEFAULT_POLICY, KernelPolicy
from megalite.model.dispatcher import dispatch_and_combine
from megalite.model.experts import LocalExperts
from megalite.model.mlp import MLP
from megalite.model.router import TopKRouter
from megalite.tensor_parallel import (gather_from_tensor_parallel, mark_sequence_parallel, recompute,
                                      scatter_to_tensor_parallel)
from megalite.tensor_parallel.mappings import SEQUENCE_DIM
from megalite.tensor_parallel.partition import REPLICATED, mark, normal_init


class SharedExpertMLP(MLP):
    """The dense MLP at --moe-shared-expert-intermediate-size, with Qwen2-MoE's optional sigmoid gate."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool = False, kernels: KernelPolicy = DEFAULT_POLICY):
        super().__init__(dataclasses.replace(cfg, ffn_hidden_size=cfg.moe_shared_expert_intermediate_size),
                         sequence_parallel, kernels)
        self.gate_weight = None
        if cfg.moe_shared_expert_gate:
            self.gate_weight = mark(nn.Parameter(torch.empty(1, cfg.hidden_size)), (1, cfg.hidden_size), REPLICATED,
                                    normal_init(cfg.init_method_std))
            if sequence_parallel:   # applied to this rank's sequence shard: partial gradients, summed over TP
                mark_sequence_parallel(self.gate_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.gate_weight is None else torch.sigmoid(F.linear(x, self.gate_weight)) * out


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sequence_parallel: bool = False, kernels: KernelPolicy = DEFAULT_POLICY,
                 layer_number: int = 0):
        super().__init__()
        self.cfg, self.layer_number = cfg, layer_number
        self.sequence_parallel = sequence_parallel
        self.router = TopKRouter(cfg)
        self.experts = LocalExperts(cfg)
        self.shared_experts = (SharedExpertMLP(cfg, sequence_parallel, kernels)
                               if cfg.moe_shared_expert_intermediate_size else None)
        self.recompute_shared = "shared_experts" in cfg.recomputed_modules()   # --recompute-modules shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq (or this rank's sequence shard), hidden] -> the same shape."""
        split = self.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1
        # Every TP rank computes the whole sequence identically: gather it, and in backward keep only this rank's
        # part of the (equal) gradients; at the end keep this rank's part of the output (backward: gather).
        full = gather_from_tensor_parallel(x, SEQUENCE_DIM) if split else x
        batch, seq, hidden = full.shape
        tokens = full.reshape(batch * seq, hidden)
        routing, routing_map = self.router(tokens, batch)
        out = dispatch_and_combine(self.cfg.moe_token_dispatcher_type, tokens, routing, routing_map, self.experts)
        out = out.view(batch, seq, hidden)
        if split:
            out = scatter_to_tensor_parallel(out, SEQUENCE_DIM)
        if self.shared_experts is None:
            return out
        if self.recompute_shared and self.training and torch.is_grad_enabled():
            return out + recompute(self.shared_experts, None, x)
        return out + self.shared_experts(x)


def moe_layers(modules: Iterable[nn.Module]) -> list[MoELayer]:
    """The MoE layers of these modules (model chunks), in order."""
    return [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]
