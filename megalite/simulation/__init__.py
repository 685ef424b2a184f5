"""Simulated GPUs: check an N-GPU job on any machine before paying for real ones (``--simulate-gpus N``).

Rank R's real code path runs in this process (megalite.simulation.run) on meta tensors standing for device memory,
over torch's fake process group held to NCCL's rules (world, communication); it reports peak memory by category next
to the planner's estimate, the collectives and host reads of a step, and every broken rule (a CPU tensor in a
collective, a wrongly laid-out FP8 operand, a p2p bookkeeping NCCL's coalesced batches break, ...). Not checked:
speed, numerics (no values exist), NCCL's own hangs, the fused kernels (they run as torch ops).
"""

from megalite.simulation.run import RankReport, simulate_rank

__all__ = ["RankReport", "simulate_rank"]
