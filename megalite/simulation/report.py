"""What a simulated run prints: each rank's peak device memory by category beside the planner's estimate for the same
rank and layout, the collectives of one step, the host reads, and the broken rules."""

from __future__ import annotations

from megalite.planner.hardware import GiB
from megalite.planner.memory import StageMemory

# The GPUs --simulate-device knows: their name and memory (GiB, about what torch reports as total).
DEVICES = {"h100": ("H100 SXM 80GB", 80.0), "h200": ("H200 141GB", 140.0), "a100": ("A100 80GB", 80.0),
           "b200": ("B200 192GB", 180.0)}

# Bytes one rank puts on the wire per byte of the counted tensor (megalite.simulation.communication's conventions),
# for a ring over n ranks: what the planner's communication model counts.
_WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "all_gather": lambda n: (n - 1) / n, "all_to_all_single": lambda n: (n - 1) / n,
         "send": lambda n: 1.0, "recv": lambda n: 0.0, "broadcast": lambda n: 1.0}


def memory_lines(report, planned: StageMemory) -> list[str]:
    """Simulated against planned bytes, by category, and the ratio of the totals (in GiB, or MiB below one)."""
    s = report.peak_by_category
    unit, scale = ("GiB", GiB) if max(planned.total, report.peak_bytes) >= GiB else ("MiB", 2**20)
    rows = [("weights", s["weights"], planned.weights), ("gradients", s["gradients"], planned.gradients),
            ("optimizer states", s["optimizer"], planned.optimizer),
            ("activations + buffers", s["activations"] + s["communication"], planned.activations + planned.gathered)]
    lines = [f"    {unit:<24}{'simulated':>10}{'planned':>10}"]
    lines += [f"    {name:<24}{sim / scale:>10.3f}{plan / scale:>10.3f}" for name, sim, plan in rows]
    ratio = report.peak_bytes / planned.total if planned.total else float("inf")
    lines.append(f"    {'peak':<24}{report.peak_bytes / scale:>10.3f}{planned.total / scale:>10.3f}   simulated / "
                 f"planned {ratio:.3f} (peak during {report.peak_phase})")
    return lines


def communication_lines(report, group_sizes: dict[str, int]) -> list[str]:
    """The collectives of one step (the second iteration): calls and bytes by operation and group."""
    lines = [f"    {'collectives of one step':<34}{'calls':>7}{'MiB counted':>13}{'MiB on the wire':>17}"]
    wire_total = 0.0
    for (op, kind), (calls, _, nbytes) in sorted(report.communication.items(), key=lambda kv: -kv[1][2]):
        n = group_sizes.get(kind, 2)
        wire = nbytes * _WIRE.get(op, lambda n: 1.0)(n)
        wire_total += wire
        lines.append(f"    {op + ' over ' + kind + f' ({n})':<34}{calls:>7}{nbytes / 2**20:>13.2f}{wire / 2**20:>17.2f}")
    lines.append(f"    {'sent per step':<34}{'':>7}{'':>13}{wire_total / 2**20:>17.2f}")
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
