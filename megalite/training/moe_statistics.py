"""The MoE layers' part of a training step: the weight of their balancing losses before it, and after it their
statistics over the global batch and the expert-bias update.

Before each global batch every router gets ``loss_weight`` = micro-batch / global batch size and the fp16 loss
scale (megalite.model.router explains why). During the step each router adds up, on this rank, the tokens each
expert received, its weighted losses and the (token, expert) assignments dropped by capacity. After it the sums
are added over DP x CP (every rank's share of the global batch; TP ranks count the same tokens and are not
added), each expert bias moves towards equal loads from those global counts, identically on every rank, and the
pipeline stages pool their layers so that every rank can report all of them:

- ``moe_layers``: the global index of each MoE layer, the order of the lists below;
- ``moe_aux_loss`` (with --moe-aux-loss-coeff > 0 and a load-balancing type) and ``moe_z_loss`` (with
  --moe-z-loss-coeff): each layer's loss, coefficient included, averaged over the global batch's micro-batches;
- ``moe_load_max`` and ``moe_load_mean``: tokens per expert over the global batch, the largest and the mean
  (k x tokens / E when nothing is dropped; max / mean is the imbalance);
- ``moe_dropped`` (with --moe-expert-capacity-factor): (token, expert) assignments dropped.
"""

from __future__ import annotations

import torch

from megalite import parallel_state
from megalite.config import ModelConfig
from megalite.model.moe import moe_layers
from megalite.training.hooks import StepHook


class MoEStatistics(StepHook):
    def __init__(self, chunks, cfg: ModelConfig, micro_batch_size: int, device: torch.device):
        self.cfg, self.device = cfg, device
        self.layers = moe_layers(chunks)
        pattern = cfg.moe_layers()
        # Multi-token prediction's layers (numbered after the model's) are MoE layers where the last one is.
        pattern += [pattern[-1]] * (cfg.mtp_num_layers or 0)
        self.layer_numbers = [i for i, moe in enumerate(pattern) if moe]
        self.micro_batch_size = micro_batch_size

    def before_forward_backward(self, loss_scale: float, global_batch_size: int) -> None:
        for layer in self.layers:
            router = layer.router
            router.loss_weight, router.loss_scale = self.micro_batch_size / global_batch_size, loss_scale
            router.reset_statistics()

    def after_grad_sync(self) -> dict:
        """Global statistics (collective), expert-bias updates, the metrics."""
        if not self.layer_numbers:
            return {}
        experts = self.cfg.num_experts
        table = torch.zeros(len(self.layer_numbers), experts + 3, device=self.device)
        rows = [self.layer_numbers.index(layer.layer_number) for layer in self.layers]
        for row, layer in zip(rows, self.layers):
            table[row] = layer.router.statistics(self.device)
        parallel_state.get_data_parallel_group(with_context_parallel=True).sum(table)
        for row, layer in zip(rows, self.layers):
            layer.router.update_expert_bias(table[row, :experts])
        parallel_state.get_pipeline_model_parallel_group().sum(table)   # each stage filled its own rows
        tokens = table[:, :experts]
        metrics = {"moe_layers": self.layer_numbers, "moe_load_max": tokens.max(dim=1).values.tolist(),
                   "moe_load_mean": tokens.mean(dim=1).tolist()}
        m = self.cfg
        if m.moe_router_load_balancing_type != "none" and m.moe_aux_loss_coeff > 0:
            metrics["moe_aux_loss"] = table[:, experts].tolist()
        if m.moe_z_loss_coeff is not None:
            metrics["moe_z_loss"] = table[:, experts + 1].tolist()
        if m.moe_expert_capacity_factor is not None:
            metrics["moe_dropped"] = [int(v) for v in table[:, experts + 2].tolist()]
        return metrics
