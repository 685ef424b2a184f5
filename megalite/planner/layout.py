"""A candidate layout: how the GPUs split the model and the batch, and the memory-saving options on top.

One ``Layout`` maps one-to-one onto megalite options (``flags()``), and back (``from_config``), so what the planner
ranks is exactly what ``pretrain_gpt.py`` would run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megalite.config import MegaliteConfig, ModelConfig


@dataclass(frozen=True)
class Layout:
    tp: int = 1                          # tensor-parallel size
    pp: int = 1                          # pipeline-parallel size
    dp: int = 1                          # data-parallel size
    virtual_stages: int = 1              # V: model chunks per pipeline rank (interleaved 1F1B when > 1)
    micro_batch_size: int = 1
    distributed_optimizer: bool = False  # ZeRO-1: fp32 main params and Adam states sharded over DP
    zero_stage: int = 1                  # 2: gradients sharded too (with the distributed optimizer); 3 (without
                                         # it): parameters too, FSDP2 (megalite.distributed.fully_sharded)
    sequence_parallel: bool = False
    recompute: Optional[str] = None      # None | "selective" | "full" (full: uniform, one layer per group)
    optimizer_cpu_offload: bool = False  # main params and Adam states on the host (never proposed by the search)
    offload_params: bool = False         # ZeRO-3 with the above: parameter and gradient shards on the host too

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def zero(self) -> int:
        """0 (plain data parallel), 1 or 2 (the distributed optimizer), or 3 (FSDP2, which stands on its own)."""
        if self.zero_stage == 3:
            return 3
        return self.zero_stage if self.distributed_optimizer else 0

    @property
    def optimizer_name(self) -> str:
        offload = "+offload" if self.optimizer_cpu_offload else ""
        return {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[self.zero] + offload + \
            ("+params" if self.offload_params else "")

    def num_micro_batches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.micro_batch_size * self.dp)

    def describe(self) -> str:
        parts = [f"TP={self.tp} x PP={self.pp} x DP={self.dp}"]
        if self.virtual_stages > 1:
            parts.append(f"V={self.virtual_stages}")
        parts.append(f"micro-batch {self.micro_batch_size}")
        parts.append(self.optimizer_name)
        if self.sequence_parallel:
            parts.append("SP")
        if self.recompute:
            parts.append(f"{self.recompute} recompute")
        return ", ".join(parts)

    def model_config(self, model: ModelConfig) -> ModelConfig:
        """The model config with this layout's recompute options."""
        if self.recompute is None:
            return dataclasses.replace(model, recompute_granularity=None, recompute_method=None,
                                       recompute_num_layers=1)
        return dataclasses.replace(model, recompute_granularity=self.recompute,
                                   recompute_method="uniform" if self.recompute == "full" else None,
                                   recompute_num_layers=1)

    def flags(self) -> list[str]:
        """The pretrain_gpt.py flags of this layout (defaults left out)."""
        flags = []
        if self.tp > 1:
            flags += ["--tensor-model-parallel-size", str(self.tp)]
        if self.pp > 1:
            flags += ["--pipeline-model-parallel-size", str(self.pp)]
        if self.virtual_stages > 1:
            flags += ["--num-virtual-stages-per-pipeline-rank", str(self.virtual_stages)]
        if self.sequence_parallel:
            flags.append("--sequence-parallel")
        flags += ["--micro-batch-size", str(self.micro_batch_size)]
        if self.distributed_optimizer:
            flags.append("--use-distributed-optimizer")
        if self.zero_stage != 1:
            flags += ["--zero-stage", str(self.zero_stage)]
        # ZeRO-3 refuses our engine's overlap options: FSDP2 overlaps its gathers and reductions itself.
        if self.distributed_optimizer:
            flags.append("--overlap-param-gather")
        if self.dp > 1 and self.zero != 3:
            flags.append("--overlap-grad-reduce")
        if self.optimizer_cpu_offload:
            flags.append("--optimizer-cpu-offload")
        if self.offload_params:
            flags.append("--offload-params")
        if self.recompute == "selective":
            flags += ["--recompute-granularity", "selective"]
        elif self.recompute == "full":
            flags += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        return flags

    @classmethod
    def from_config(cls, cfg: MegaliteConfig, world_size: int) -> "Layout":
        """The layout a validated config describes at this world size."""
        p, o = cfg.parallel, cfg.optimizer
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), virtual_stages=p.virtual_stages(cfg.model.num_layers),
                   micro_batch_size=cfg.training.micro_batch_size, distributed_optimizer=o.use_distributed_optimizer,
                   zero_stage=o.zero_stage, sequence_parallel=p.sequence_parallel,
                   recompute=cfg.model.recompute_granularity, optimizer_cpu_offload=o.optimizer_cpu_offload,
                   offload_params=o.offload_params)
