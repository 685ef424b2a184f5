"""A candidate layout: how the GPUs split the model and the batch, and the memory-saving options on top.

One ``Layout`` maps one-to-one onto megalite options: ``apply`` sets them on a config and ``from_config`` reads them
back, so what the planner ranks is exactly what ``pretrain_gpt.py`` would run (its flags are the config's, spelled by
megalite.config.flags).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

from megalite.config import MegaliteConfig, ModelConfig, OptimizerConfig, flags
from megalite.config.dims import ParallelDims
from megalite.config.pipeline_split import layout_text
from megalite.pipeline.schedules import placement_of


@dataclass(frozen=True)
class Layout:
    tp: int = 1                          # tensor-parallel size
    pp: int = 1                          # pipeline-parallel size
    dp: int = 1                          # data-parallel size
    virtual_stages: int = 1              # V: model chunks per pipeline rank (interleaved when > 1; zbv: 2)
    pipeline_schedule: str = "1f1b"      # ParallelConfig.pipeline_schedule: 1f1b | zero-bubble | zbv
    micro_batch_size: int = 1
    zero: int = 0                        # OptimizerConfig.zero_level: 0 plain DP, 1-2 the distributed optimizer
                                         # (states, then gradients sharded), 3 parameters too (FSDP2)
    sequence_parallel: bool = False
    recompute: Optional[str] = None      # None | "selective" | "full" (full: uniform, one layer per group)
    optimizer_cpu_offload: bool = False  # main params and Adam states on the host (never proposed by the search)
    offload_params: bool = False         # ZeRO-3 with the above: parameter and gradient shards on the host too
    cp: int = 1                          # context-parallel size: ranks splitting each sample's sequence
    cp_comm_type: str = "p2p"            # p2p (ring) | a2a | allgather | a2a+p2p
    cp_a2a: int = 1                      # a2a+p2p: the all-to-all level's ranks (the ring has CP / cp_a2a)
    ep: int = 1                          # expert-parallel size (carved from DP x CP): E / EP experts per rank
    experts_split: bool = True           # routed experts split over TP (--expert-tensor-parallel-size TP), or whole
    split: Optional[tuple[int, ...]] = None   # transformer layers per virtual stage when uneven; None: even
    muon: bool = False                   # --optimizer muon: the hidden matrices keep one state buffer, not two
    muon_tp_mode: str = "duplicated"     # --muon-tp-mode: how a TP-split matrix is orthogonalized
    muon_ns_steps: int = 5               # --muon-num-ns-steps
    muon_split_qkv: bool = True          # not --muon-no-split-qkv: q, k and v orthogonalized as three matrices
    instances: int = 1                   # HSDP: ZeRO shards over DP x CP / instances ranks, replicated across them
                                         # (--num-distributed-optimizer-instances; never proposed by the search)

    @functools.cached_property
    def dims(self) -> ParallelDims:
        """The layout's sizes, and those derived from them, as the run computes them."""
        return ParallelDims(self.world_size, self.tp, self.cp, self.pp, self.ep, None if self.experts_split else 1,
                            self.instances)

    @property
    def expert_tp(self) -> int:
        """The routed experts' tensor-parallel size."""
        return self.dims.expert_tp

    @property
    def expert_dp(self) -> int:
        """The ranks holding the same experts, over which their gradients are reduced and their states sharded."""
        return self.dims.expert_dp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def replicas(self) -> int:
        """DP x CP: the ranks holding the same model shard, over which gradients are reduced and ZeRO shards."""
        return self.dims.dp_cp

    @property
    def shard_replicas(self) -> int:
        """The ranks ZeRO shards over: DP x CP, or with HSDP one instance of them (DP x CP / instances)."""
        return self.dims.shard_dp

    @property
    def optimizer_name(self) -> str:
        offload = "+offload" if self.optimizer_cpu_offload else ""
        return {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[self.zero] + offload + \
            ("+params" if self.offload_params else "") + (f" (HSDP {self.instances} x {self.shard_replicas})"
                                                          if self.instances > 1 else "")

    @property
    def placement(self) -> str:
        """How the schedule puts the model chunks on the ranks (megalite.pipeline.partition)."""
        return placement_of(self.pipeline_schedule)

    def num_micro_batches(self, global_batch_size: int) -> int:
        return self.dims.micro_batches(global_batch_size, self.micro_batch_size)

    def describe(self) -> str:
        context = f"CP={self.cp} ({self.cp_comm_type}) x " if self.cp > 1 else ""
        parts = [f"TP={self.tp} x {context}PP={self.pp} x DP={self.dp}" + (f" (EP={self.ep})" if self.ep > 1 else "")]
        if self.virtual_stages > 1:
            parts.append(f"V={self.virtual_stages}")
        if self.split is not None:
            parts.append("layers " + "/".join(map(str, self.split)))
        if self.pipeline_schedule != "1f1b" and self.pp > 1:
            parts.append(self.pipeline_schedule)
        parts.append(f"micro-batch {self.micro_batch_size}")
        parts.append(self.optimizer_name)
        if self.sequence_parallel:
            parts.append("SP")
        if self.recompute:
            parts.append(f"{self.recompute} recompute")
        return ", ".join(parts)

    def model_config(self, model: ModelConfig) -> ModelConfig:
        """The model config with this layout's recompute options."""
        return dataclasses.replace(model, recompute_granularity=self.recompute,
                                   recompute_method="uniform" if self.recompute == "full" else None,
                                   recompute_num_layers=1,   # --recompute-modules only with selective recompute
                                   recompute_modules=model.recompute_modules if self.recompute == "selective" else None)

    def apply(self, cfg: MegaliteConfig) -> MegaliteConfig:
        """``cfg`` running this layout (its world size is the launcher's: TP x CP x PP x DP processes)."""
        parallel = dataclasses.replace(
            cfg.parallel, tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            context_parallel_size=self.cp, cp_comm_type=self.cp_comm_type,
            hierarchical_context_parallel_sizes=(f"{self.cp_a2a} {self.cp // self.cp_a2a}"
                                                 if self.cp_comm_type == "a2a+p2p" else None),
            sequence_parallel=self.sequence_parallel, num_layers_per_virtual_pipeline_stage=None,
            num_virtual_stages_per_pipeline_rank=self.virtual_stages if self.virtual_stages > 1 else None,
            pipeline_schedule=self.pipeline_schedule, **self._split_options(cfg.model),
            expert_model_parallel_size=self.ep, expert_tensor_parallel_size=None if self.experts_split else 1,
            num_distributed_optimizer_instances=self.instances)
        # Overlap whatever our engine can: ZeRO-3 refuses these options (FSDP2 overlaps its own gathers and
        # reductions), and there is nothing to reduce without data parallelism.
        optimizer = dataclasses.replace(
            cfg.optimizer, **OptimizerConfig.zero_settings(self.zero),
            overlap_grad_reduce=self.replicas > 1 and self.zero != 3, overlap_param_gather=self.zero in (1, 2),
            optimizer_cpu_offload=self.optimizer_cpu_offload, offload_params=self.offload_params)
        training = dataclasses.replace(cfg.training, micro_batch_size=self.micro_batch_size)
        return dataclasses.replace(cfg, model=self.model_config(cfg.model), parallel=parallel, optimizer=optimizer,
                                   training=training)

    def _split_options(self, model: ModelConfig) -> dict:
        """The split as Megatron's layout string (the other ways of splitting cleared), or none at all."""
        layout = None if self.split is None else layout_text(self.split, model.mtp_num_layers or 0)
        return dict(pipeline_model_parallel_layout=layout, decoder_first_pipeline_num_layers=None,
                    decoder_last_pipeline_num_layers=None, account_for_embedding_in_pipeline_split=False,
                    account_for_loss_in_pipeline_split=False)

    def argv(self, cfg: MegaliteConfig) -> list[str]:
        """The command-line words that turn ``cfg`` into this layout."""
        return flags.argv(flags.differences(self.apply(cfg), cfg))

    @classmethod
    def from_config(cls, cfg: MegaliteConfig, world_size: int) -> "Layout":
        """The layout a validated config describes at this world size."""
        p, o = cfg.parallel, cfg.optimizer
        tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
        return cls(tp=tp, pp=pp, dp=ParallelDims.of(p, world_size).dp,
                   virtual_stages=p.virtual_stages(cfg.model.num_layers),
                   micro_batch_size=cfg.training.micro_batch_size, zero=o.zero_level,
                   pipeline_schedule=p.pipeline_schedule,
                   sequence_parallel=p.sequence_parallel, recompute=cfg.model.recompute_granularity,
                   optimizer_cpu_offload=o.optimizer_cpu_offload, offload_params=o.offload_params, cp=cp,
                   cp_comm_type=p.cp_comm_type, ep=p.expert_model_parallel_size,
                   cp_a2a=(p.hierarchical_context_parallel() or (1, 1))[0],
                   experts_split=p.expert_tensor_parallel_size in (None, tp), muon=o.optimizer == "muon",
                   muon_tp_mode=o.muon_tp_mode, muon_ns_steps=o.muon_num_ns_steps,
                   muon_split_qkv=not o.muon_no_split_qkv,
                   split=p.pipeline_split(cfg.model), instances=p.num_distributed_optimizer_instances)
