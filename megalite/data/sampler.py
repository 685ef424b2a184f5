"""Which global sample indices each data-parallel rank reads, Megatron's way.

Iteration ``k`` consumes samples [k*G, (k+1)*G) of the global order (G = global batch). Its micro-step ``m`` takes the
next micro_batch_size x DP of them, and DP rank ``r`` gets the r-th run of micro_batch_size. Whatever DP and the
micro-batch size are, one iteration covers the same G samples, so losses averaged over the global batch agree.
"""

from __future__ import annotations


def micro_batch_indices(consumed_samples: int, micro_batch_size: int, num_micro_batches: int,
                        dp_rank: int, dp_size: int) -> list[list[int]]:
    """Sample indices of each micro-batch this DP rank runs in the iteration starting at ``consumed_samples``."""
    step = micro_batch_size * dp_size
    batches = []
    for m in range(num_micro_batches):
        first = consumed_samples + m * step + dp_rank * micro_batch_size
        batches.append(list(range(first, first + micro_batch_size)))
    return batches
