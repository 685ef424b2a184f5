"""Pipeline schedules (so far: none, i.e. gradient accumulation)."""

from megalite.pipeline.schedules import forward_backward_no_pipelining, get_forward_backward_func

__all__ = ["forward_backward_no_pipelining", "get_forward_backward_func"]
