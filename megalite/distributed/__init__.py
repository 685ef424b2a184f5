"""Data parallelism: the bucketed gradient engine and parameter gathering for the distributed optimizer."""

from megalite.distributed.buckets import Bucket, BufferLayout, build_layout
from megalite.distributed.data_parallel import DataParallel

__all__ = ["Bucket", "BufferLayout", "build_layout", "DataParallel"]
