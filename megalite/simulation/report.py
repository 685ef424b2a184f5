"""What a simulated run prints: each rank's peak device memory by category beside the planner's estimate for the same
rank and layout, the collectives of one step, the host reads, and the broken rules."""

from __future__ import annotations

from megalite.planner.hardware import GiB, Hardware
from megalite.planner.memory import StageMemory
from megalite.planner.performance import StepTime, ring_all_reduce_time, ring_gather_time

# The GPUs --simulate-device knows: their name and memory (GiB, about what torch reports as total).
DEVICES = {"h100": ("H100 SXM 80GB", 80.0), "h200": ("H200 141GB", 140.0), "a100": ("A100 80GB", 80.0),
           "b200": ("B200 192GB", 180.0)}

def memory_lines(report, planned: StageMemory) -> list[str]:
    """Simulated against planned bytes, by category, and the ratio of the totals (in GiB, or MiB below one)."""
    s = report.peak_by_category
    unit, scale = ("GiB", GiB) if max(planned.total, report.peak_bytes) >= GiB else ("MiB", 2**20)
    rows = [("weights", s["weights"], planned.weights), ("gradients", s["gradients"], planned.gradients),
            ("optimizer states", s["optimizer"], planned.optimizer),
            ("activations + buffers", s["activations"], planned.activations + planned.gathered)]
    lines = [f"    {unit:<24}{'simulated':>10}{'planned':>10}"]
    lines += [f"    {name:<24}{sim / scale:>10.3f}{plan / scale:>10.3f}" for name, sim, plan in rows]
    ratio = report.peak_bytes / planned.total if planned.total else float("inf")
    lines.append(f"    {'peak':<24}{report.peak_bytes / scale:>10.3f}{planned.total / scale:>10.3f}   simulated / "
                 f"planned {ratio:.3f} (peak during {report.peak_phase})")
    return lines


# Which part of the planner's communication model a group's collectives belong to, and the span of ranks its ring
# crosses (a group inside a node runs at the node's link).
_PLANNED_AS = {"tensor": "tp", "tensor_share": "tp", "pipeline": "pp", "embedding": "dp", "data": "dp",
               "data_context": "dp", "expert_data": "dp", "context": "cp", "expert": "all_to_all",
               "intra_instance": "dp", "inter_instance": "dp"}


def _seconds(op: str, nbytes: float, n: int, bandwidth: float) -> float:
    """A collective's time in the planner's ring model (megalite.planner.performance)."""
    if op == "all_reduce":
        return ring_all_reduce_time(nbytes, n, bandwidth)
    if op in ("all_gather", "reduce_scatter", "all_to_all_single"):
        return ring_gather_time(nbytes, n, bandwidth)
    return nbytes / bandwidth if op in ("send", "broadcast") else 0.0


def communication_lines(report, group_sizes: dict[str, int], planned: StepTime, hardware: Hardware) -> list[str]:
    """The collectives of one step (the second iteration) by operation and group: calls, bytes, and their time at
    the planner's links beside the planner's own communication model of the step."""
    lines = [f"    {'collectives of one step':<36}{'calls':>7}{'MiB':>12}{'ms at the planned links':>25}"]
    simulated = {"tp": 0.0, "pp": 0.0, "dp": 0.0, "cp": 0.0, "all_to_all": 0.0}
    for (op, kind), (calls, _, nbytes) in sorted(report.communication.items(), key=lambda kv: -kv[1][2]):
        n = group_sizes.get(kind, 1)
        span = hardware.num_gpus if kind == "pipeline" else group_sizes.get(f"{kind}_span", n)
        part = _PLANNED_AS.get(kind)
        if op == "all_to_all_single":   # the token dispatch, whichever name its ranks' group got first (EP = DP x CP)
            part, span = "all_to_all", group_sizes["expert_span"]
        seconds = _seconds(op, nbytes, n, hardware.bandwidth(span))
        if part is not None:
            simulated[part] += seconds
        lines.append(f"    {op + ' over ' + kind + f' ({n})':<36}{calls:>7}{nbytes / 2**20:>12.2f}{seconds * 1e3:>25.2f}")
    model = {"tp": planned.tp, "pp": planned.pp, "dp": planned.dp, "cp": planned.cp, "all_to_all": planned.all_to_all}
    shown = [part for part in simulated if simulated[part] or model[part]]
    lines.append("    communication per step (ms), simulated at the planned links / the planner's model: "
                 + ", ".join(f"{part.upper() if part != 'all_to_all' else 'EP'} {simulated[part] * 1e3:.2f} / "
                             f"{model[part] * 1e3:.2f}" for part in shown))
    return lines


def host_read_lines(report) -> list[str]:
    if not report.host_reads:
        return ["    host reads per step: none"]
    reads = sorted(report.host_reads.items(), key=lambda kv: -kv[1])
    total = sum(n for _, n in reads)
    return [f"    host reads per step (each a GPU stream sync): {total}"] + \
        [f"      {n:>4}  {site}" for site, n in reads]


def summary_line(reports, planned_by_stage: dict[int, StageMemory], device: str) -> str:
    """The worst rank: its peak against the device's memory and the planner."""
    name, memory_gib = DEVICES[device]
    worst = max(reports, key=lambda r: r.peak_bytes)
    planned = planned_by_stage[worst.coordinates["pp"]]
    fits = worst.peak_bytes <= memory_gib * GiB
    return (f"megalite: simulated {len(reports)} rank(s): the most loaded, rank {worst.rank}, peaks at "
            f"{worst.peak_bytes / GiB:.2f} GiB (planned {planned.total / GiB:.2f} GiB) of the {name}'s "
            f"{memory_gib:g} GiB: {'fits' if fits else 'DOES NOT FIT'}")
