"""The machine a plan is for: GPUs (memory, peak bf16 FLOP/s), how many share a node, and the two kinds of link.

Bandwidths are per GPU and per direction, in bytes per second, the number a ring collective over that link achieves
at best (bus bandwidth). Defaults, each overridable:

- NVLink: 450 GB/s (H100 SXM: 18 NVLink-4 links x 25 GB/s per direction; A100: 300 GB/s).
- PCIe: 32 GB/s (gen4 x16; gen5 x16 is about 64 GB/s). Without NVLink, GPU-to-GPU traffic inside a node goes
  through the PCIe switches (and the CPU), so the per-GPU figure is the link's.
- InfiniBand: 400 Gb/s = 50 GB/s per GPU (one NDR NIC per GPU, as in a DGX H100).
- RoCE: 200 Gb/s = 25 GB/s per GPU; Ethernet: 100 Gb/s = 12.5 GB/s per GPU (TCP, no GPUDirect: optimistic).

The default GPU is H100-80GB-like: 80 GB, 989 dense bf16 TFLOP/s, 8 per node, NVLink inside, InfiniBand across.
"""

from __future__ import annotations

from dataclasses import dataclass

from megalite.model.flops import PEAK_BF16_TFLOPS

GB = 1e9      # link bandwidths are quoted in decimal units
GiB = 2**30   # memory in binary ones


def gib(value: float) -> str:
    """Bytes in GiB, or MiB below one GiB (the tests' tiny models)."""
    return f"{value / GiB:.1f} GiB" if value >= GiB else f"{value / 2**20:.1f} MiB"

INTRA_NODE_BANDWIDTH_GBPS = {"nvlink": 450.0, "pcie": 32.0}                          # GB/s per direction
INTER_NODE_BANDWIDTH_GBITPS = {"infiniband": 400.0, "roce": 200.0, "ethernet": 100.0}   # Gb/s per GPU


@dataclass(frozen=True)
class Hardware:
    num_gpus: int = 8
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0         # an "80 GB" H100 has 80 GiB of HBM (torch reports 79.1 GiB usable)
    peak_tflops: float = PEAK_BF16_TFLOPS["H100"]   # dense bf16 tensor-core peak (H100 SXM)
    fp8_peak_ratio: float = 2.0          # dense FP8 / bf16 peak: Hopper and Ada 2 (H100 SXM 1979 / 989), A100 1 (none)
    intra_node_link: str = "nvlink"      # nvlink | pcie
    intra_node_gbps: float | None = None  # GB/s per direction per GPU; None: the link's default above
    inter_node_network: str = "infiniband"   # infiniband | roce | ethernet
    inter_node_gbitps: float | None = None   # Gb/s per GPU; None: the network's default above
    efficiency: float = 0.5              # achieved / peak FLOP/s of the compute kernels (0.4-0.6 on real runs)
    memory_headroom: float = 0.10        # kept free: CUDA context, NCCL buffers, allocator fragmentation, workspaces

    def __post_init__(self):
        if self.intra_node_link not in INTRA_NODE_BANDWIDTH_GBPS:
            raise ValueError(f"intra-node link must be one of {', '.join(INTRA_NODE_BANDWIDTH_GBPS)}, "
                             f"got {self.intra_node_link!r}")
        if self.inter_node_network not in INTER_NODE_BANDWIDTH_GBITPS:
            raise ValueError(f"inter-node network must be one of {', '.join(INTER_NODE_BANDWIDTH_GBITPS)}, "
                             f"got {self.inter_node_network!r}")
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"need at least one GPU and one GPU per node, got {self.num_gpus} and "
                             f"{self.gpus_per_node}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"{self.num_gpus} GPUs do not fill whole nodes of {self.gpus_per_node}")
        if self.fp8_peak_ratio < 1:
            raise ValueError(f"the FP8 / bf16 peak ratio must be >= 1, got {self.fp8_peak_ratio}")
        if not (0 < self.efficiency <= 1 and 0 <= self.memory_headroom < 1):
            raise ValueError("efficiency must be in (0, 1] and memory headroom in [0, 1)")

    @property
    def intra_bandwidth(self) -> float:
        """Bytes/s per GPU per direction inside a node."""
        return (self.intra_node_gbps or INTRA_NODE_BANDWIDTH_GBPS[self.intra_node_link]) * GB

    @property
    def inter_bandwidth(self) -> float:
        """Bytes/s per GPU per direction across nodes."""
        return (self.inter_node_gbitps or INTER_NODE_BANDWIDTH_GBITPS[self.inter_node_network]) * GB / 8

    @property
    def memory_bytes(self) -> float:
        return self.gpu_memory_gib * GiB

    @property
    def usable_memory_bytes(self) -> float:
        """What a layout may plan to use: the device minus the headroom."""
        return self.memory_bytes * (1.0 - self.memory_headroom)

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    def bandwidth(self, span: int) -> float:
        """The slowest link a ring over ``span`` consecutive ranks crosses: the node's link, and the network too
        once the ranks fill more than one node."""
        if span <= self.gpus_per_node:
            return self.intra_bandwidth
        return min(self.intra_bandwidth, self.inter_bandwidth)

    def describe(self) -> str:
        nodes = max(1, self.num_gpus // self.gpus_per_node)
        per_node = min(self.num_gpus, self.gpus_per_node)
        return (f"{self.num_gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} x {per_node}), {self.gpu_memory_gib:g} "
                f"GiB, {self.peak_tflops:g} TFLOP/s bf16 peak at {self.efficiency:.0%} efficiency; {self.intra_node_link} {self.intra_bandwidth / GB:g} GB/s inside a node, "
                f"{self.inter_node_network} {self.inter_bandwidth * 8 / GB:g} Gb/s across nodes")
