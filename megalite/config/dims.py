"""The layout's sizes at a world size, and every size derived from them: written here once, read everywhere.

Megatron's rank order: TP innermost, then CP, then DP, then PP outermost; the routed experts' ranks are carved from
DP x CP (EP innermost there, then expert-DP), with their own tensor-parallel size ETP (TP or 1). Like torchtitan's
``ParallelDims``: validation, the DeepSpeed translation, the process groups, the planner and checkpoints ask this
object instead of dividing the world themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.config.flags import FLAG
from megalite.config.schema import ConfigError, ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    world: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None    # the routed experts' tensor-parallel size: None (= TP) or 1
    instances: int = 1           # distributed-optimizer instances (HSDP): DP x CP split into this many shard groups

    @classmethod
    def of(cls, parallel: ParallelConfig, world: int) -> "ParallelDims":
        """The sizes a config gives at ``world`` ranks; ConfigError (one line) if TP x CP x PP does not divide it."""
        dims = cls(world, parallel.tensor_model_parallel_size, parallel.context_parallel_size,
                   parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size,
                   parallel.expert_tensor_parallel_size, parallel.num_distributed_optimizer_instances)
        dims.check()
        return dims

    def check(self) -> None:
        """ConfigError naming the sizes when one is below 1 or the world is not a whole number of TP x CP x PP model
        replicas."""
        for flag, size in ((FLAG.tensor_model_parallel_size, self.tp), (FLAG.context_parallel_size, self.cp),
                           (FLAG.pipeline_model_parallel_size, self.pp)):
            if size < 1:   # before the command line is validated (the DeepSpeed translation asks first)
                raise ConfigError(f"{flag} must be >= 1, got {size}")
        if not self.whole_replicas:
            context = f"{FLAG.context_parallel_size} {self.cp} x " if self.cp > 1 else ""
            raise ConfigError(f"world size {self.world} is not divisible by {FLAG.tensor_model_parallel_size} "
                              f"{self.tp} x {context}{FLAG.pipeline_model_parallel_size} {self.pp} = "
                              f"{self.model_parallel}")
        if self.instances < 1 or self.dp_cp % self.instances:
            raise ConfigError(f"{FLAG.num_distributed_optimizer_instances} {self.instances} does not divide the "
                              f"data-parallel x context-parallel size {self.dp_cp}")

    @property
    def whole_replicas(self) -> bool:
        """Whether the world is a whole number of TP x CP x PP model replicas."""
        return self.world % self.model_parallel == 0

    @property
    def model_parallel(self) -> int:
        """Ranks holding one replica of the model: TP x CP x PP (CP ranks hold the same weights, but one replica's
        samples are spread over them)."""
        return self.tp * self.cp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel size: world / (TP x CP x PP), the replicas that each take a slice of the global batch."""
        return self.world // self.model_parallel

    @property
    def dp_cp(self) -> int:
        """DP x CP: the ranks that hold the same weights and share a global batch's tokens (gradients are summed,
        and the distributed optimizer shards, over them)."""
        return self.dp * self.cp

    @property
    def shard_dp(self) -> int:
        """The ranks of one distributed-optimizer instance, over which ZeRO shards: DP x CP / instances (HSDP)."""
        return self.dp_cp // self.instances

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same routed experts: DP x CP / EP."""
        return self.dp_cp // self.ep

    def micro_batches(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches each DP rank runs (accumulates) for one global batch."""
        return global_batch_size // (micro_batch_size * self.dp)
