"""The MoE router: score every expert for each token, keep the top k, drop what exceeds an expert's capacity, and
attach the load-balancing losses (Megatron-core's TopKRouter, in one module).

Scores, for logits z = x W^T (+ b with the linears' biases, as Megatron's router and gpt-oss'; W: [experts,
hidden] and b replicated over TP), in fp32 whatever the model dtype:

- softmax (Mixtral, Qwen3-MoE): softmax over the k largest logits, weights summing to 1; with ``pre_softmax`` the
  softmax runs over all experts first and the k largest probabilities are used as they are (Qwen2-MoE);
- sigmoid (DeepSeek-V3): sigmoid(z) per expert, the k chosen normalized to sum 1. With the expert bias b
  (auxiliary-loss-free balancing, Wang et al. 2024), the k are chosen by sigmoid(z) + b but weighted by sigmoid(z);
  after every step b moves by ``rate x sign(mean load - load)`` (``update_expert_bias``), from the tokens each
  expert received over the whole global batch, so it is the same on every rank.

Either way a scaling factor then multiplies the weights (DeepSeek-V3's routed_scaling_factor, after the sigmoid's
normalization).

Group-limited routing (DeepSeek-V3's node-limited routing; Megatron's group_limited_topk): the E experts, in
order, form G equal groups; a group scores the sum of its k/g highest scores (those the top k is taken over: the
logits, the softmax, or the sigmoid plus the expert bias), and each token's top k come only from its g best groups.
DeepSeek-V3 (k = 8, g = 4) sums each group's top 2, as transformers' DeepseekV3TopkRouter always does.

A capacity factor c limits every expert to ceil(c x T x k / E) of a micro-batch's T tokens (on this rank, as
Megatron): it keeps its highest-weight tokens (``probs``) or its earliest (``position``); the others lose that
expert (dropped, not rerouted).

Losses, computed only when training with gradients (so once under activation recompute: in the replay), over the
routing *before* dropping (each token's plain top k of s, without groups, as Megatron), with the scores s (softmax
over all experts, or sigmoid normalized per token):

- aux_loss (Switch Transformer): coeff x E / (k T^2) x sum_e (sum_t s_te) x (tokens routed to e);
- seq_aux_loss (DeepSeek-V2): the same per sequence, averaged over the micro-batch's sequences;
- z-loss (ST-MoE): coeff x mean_t logsumexp(z_t)^2.

Under context parallelism a rank holds part of each sequence: the token counts are summed over CP first and each
rank's loss is its share of the whole sequence's (they add up over CP, as gradients do). Each loss enters backward
as Megatron's MoEAuxLossAutoScaler does: the loss is attached to the routing weights (the z-loss to the logits) and
its gradient is set to ``loss_weight x loss_scale``, where the trainer sets loss_weight = micro-batch / global batch
size: the gradient of the mean, over every micro-batch of the global batch, of each micro-batch's loss, consistent
with the LM loss (a mean over the global batch's tokens) whatever the DP size or number of micro-batches.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite import parallel_state
from megalite.config import ModelConfig
from megalite.tensor_parallel.partition import REPLICATED, mark, normal_init, zeros_init


class _AttachLoss(torch.autograd.Function):
    """``activation`` unchanged; in backward, ``loss`` receives the gradient ``scale`` (MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, activation, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return activation

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Tokens an expert may take: ceil(factor x tokens x k / experts) (Megatron's get_capacity)."""
    return math.ceil(num_tokens * topk / num_experts * factor)


class TopKRouter(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.num_experts, self.topk = cfg.num_experts, cfg.moe_router_topk
        self.weight = mark(nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size)),
                           (cfg.num_experts, cfg.hidden_size), REPLICATED, normal_init(cfg.init_method_std))
        self.bias = (None if cfg.disable_bias_linear else
                     mark(nn.Parameter(torch.empty(cfg.num_experts)), (cfg.num_experts,), REPLICATED, zeros_init))
        # State, not a parameter: initialized and saved in checkpoints like one, never stepped by the optimizer.
        self.register_buffer("expert_bias", self._marked_bias(torch.zeros(cfg.num_experts))
                             if cfg.moe_router_enable_expert_bias else None)
        # Set by the trainer before each global batch (see the module docstring).
        self.loss_weight, self.loss_scale = 1.0, 1.0
        self.reset_statistics()

    def _marked_bias(self, bias: torch.Tensor) -> torch.Tensor:
        return mark(bias, (self.num_experts,), REPLICATED, zeros_init)

    def _apply(self, fn, recurse=True):
        """The expert bias stays fp32 whatever the model dtype (its updates are ~1e-3), and keeps its marks."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None:
            self.expert_bias = self._marked_bias(self.expert_bias.float())
        return self

    # ---- statistics of the global batch: loads, losses, drops -------------------------------------------------
    def reset_statistics(self) -> None:
        self._statistics = None

    def statistics(self, device: torch.device) -> torch.Tensor:
        """[tokens per expert (E), weighted aux loss, weighted z-loss, dropped assignments] of this rank so far."""
        if self._statistics is None:
            self._statistics = torch.zeros(self.num_experts + 3, dtype=torch.float32, device=device)
        return self._statistics

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """bias += rate x sign(mean - load), from the loads of the whole global batch (equal on every rank)."""
        if self.expert_bias is not None:
            offset = tokens_per_expert.mean() - tokens_per_expert
            self.expert_bias.add_(torch.sign(offset).to(self.expert_bias) * self.cfg.moe_router_bias_update_rate)

    # ---- routing ----------------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, E] (zero off the chosen experts; the model dtype) and the routing map [T, E]."""
        logits = F.linear(tokens, self.weight, self.bias)
        counting = self.training and torch.is_grad_enabled()
        if counting and self.cfg.moe_z_loss_coeff is not None:
            logits = self._attach_z_loss(logits)
        probs, top = self._top_k(logits)
        routing = torch.zeros_like(logits).scatter(1, top, probs)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        if counting and self.cfg.moe_router_load_balancing_type != "none" and self.cfg.moe_aux_loss_coeff > 0:
            routing = self._attach_aux_loss(routing, logits, num_sequences)
        if self.cfg.moe_expert_capacity_factor is not None:
            routing, routing_map, dropped = self._drop(routing, routing_map)
        else:
            dropped = 0
        if counting:
            with torch.no_grad():
                statistics = self.statistics(logits.device)
                statistics[: self.num_experts] += routing_map.sum(dim=0)
                statistics[-1] += dropped
        return routing, routing_map

    def _top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in the logits' dtype, expert indices [T, k])."""
        cfg, k = self.cfg, self.topk
        if cfg.moe_router_score_function == "softmax":
            if cfg.moe_router_pre_softmax:
                probs, top = self._choose(torch.softmax(logits.float(), dim=-1))
            else:
                chosen, top = self._choose(logits)
                probs = torch.softmax(chosen.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            if self.expert_bias is not None:
                top = self._choose(scores + self.expert_bias)[1]
                probs = scores.gather(1, top)
            else:
                probs, top = self._choose(scores)
            if k > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.moe_router_topk_scaling_factor is not None:
            probs = probs * cfg.moe_router_topk_scaling_factor
        return probs.type_as(logits), top

    def _choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k highest scores [T, k] and their experts; with groups, only among the experts of each token's
        ``group_topk`` groups whose top k / group_topk scores sum the highest (see the module docstring)."""
        groups, eligible = self.cfg.moe_router_num_groups, self.cfg.moe_router_group_topk
        if groups is not None:
            grouped = scores.view(scores.shape[0], groups, -1)
            group_scores = grouped.topk(self.topk // eligible, dim=-1)[0].sum(dim=-1)
            best = torch.topk(group_scores, eligible, dim=-1)[1]
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
            scores = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(scores)
        return torch.topk(scores, self.topk, dim=-1)

    def _drop(self, routing: torch.Tensor, routing_map: torch.Tensor):
        """Keep at most ``capacity`` tokens per expert (by weight or by position); the number dropped."""
        limit = capacity(routing.shape[0], self.topk, self.num_experts, self.cfg.moe_expert_capacity_factor)
        if limit >= routing.shape[0]:
            return routing, routing_map, 0
        if self.cfg.moe_token_drop_policy == "probs":
            keep = torch.zeros_like(routing_map).scatter(0, torch.topk(routing, limit, dim=0)[1], True)
        else:
            keep = routing_map.cumsum(dim=0) <= limit
        kept = routing_map & keep
        dropped = routing_map.sum() - kept.sum()
        return routing * kept, kept, dropped

    # ---- losses -----------------------------------------------------------------------------------------------
    def _attach(self, activation: torch.Tensor, loss: torch.Tensor, slot: int) -> torch.Tensor:
        with torch.no_grad():
            self.statistics(loss.device)[self.num_experts + slot] += loss.detach().float() * self.loss_weight
        return _AttachLoss.apply(activation, loss, self.loss_weight * self.loss_scale)

    def _attach_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        cp = parallel_state.get_context_parallel_world_size()   # each CP rank's mean is 1/CP of the sequence's
        z = torch.logsumexp(logits.float(), dim=-1).square().mean() * (self.cfg.moe_z_loss_coeff / cp)
        return self._attach(logits, z, 1)

    def _attach_aux_loss(self, routing: torch.Tensor, logits: torch.Tensor, num_sequences: int) -> torch.Tensor:
        """The load-balancing loss of the routing before dropping (see the module docstring)."""
        cfg, k, experts = self.cfg, self.topk, self.num_experts
        if cfg.moe_router_score_function == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        chosen = torch.zeros_like(scores).scatter(1, torch.topk(scores, k, dim=-1)[1], 1.0)
        context = parallel_state.get_context_parallel_group()
        if cfg.moe_router_load_balancing_type == "aux_loss":
            counts = context.sum(chosen.sum(dim=0))
            tokens = scores.shape[0] * context.size
            loss = (scores.sum(dim=0) * counts).sum() * (experts * cfg.moe_aux_loss_coeff / (k * tokens * tokens))
        else:   # per sequence: [sequences, tokens of each, experts]
            shape = (num_sequences, -1, experts)
            counts = context.sum(chosen.view(shape).sum(dim=1))
            length = scores.view(shape).shape[1] * context.size
            load = counts / (length * k / experts)
            loss = (load * scores.view(shape).sum(dim=1) / length).sum(dim=-1).mean() * cfg.moe_aux_loss_coeff
        return self._attach(routing, loss, 0)
