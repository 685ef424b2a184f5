"""The benchmarks' communication counter is megalite's own (megalite.simulation.communication), which the simulated
GPUs also use; this name stays for the benchmarks and tests that import it."""

from megalite.simulation.communication import CommCounter, FunctionalCollectiveCounter, count_communication

__all__ = ["CommCounter", "FunctionalCollectiveCounter", "count_communication"]
