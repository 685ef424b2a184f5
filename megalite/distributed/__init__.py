"""Data parallelism behind one contract (``engine``): the bucketed gradient engine and parameter gathering for the
distributed optimizer (ZeRO-1/2), and ZeRO-3 on FSDP2; with expert parallelism one engine for the dense parameters and
one for the experts' (expert_parallel); the model-parallel gradient sums both engines finish with (finalize)."""

from megalite.distributed.buckets import Bucket, BucketPlan, plan_buckets
from megalite.distributed.data_parallel import DataParallel, default_bucket_size
from megalite.distributed.engine import DataParallelEngine, Piece
from megalite.distributed.expert_parallel import EngineUnion, is_expert
from megalite.distributed.finalize import finalize_model_grads
from megalite.distributed.fully_sharded import FullyShardedDataParallel, copy_into_parameter, full_local_tensor

__all__ = ["Bucket", "BucketPlan", "plan_buckets", "DataParallel", "DataParallelEngine", "Piece",
           "FullyShardedDataParallel", "copy_into_parameter", "full_local_tensor", "default_bucket_size", "EngineUnion",
           "is_expert", "finalize_model_grads"]
