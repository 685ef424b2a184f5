"""``--simulate-gpus N``: the ranks of an N-GPU job simulated one after the other, and what they say together."""

from __future__ import annotations

import time

import dataclasses

from megalite.config import MegaliteConfig
from megalite.planner.dry_run import dtype_bytes, run_memory
from megalite.planner.hardware import Hardware
from megalite.planner.layout import Layout
from megalite.planner.performance import StepTime, step_time
from megalite.simulation import report
from megalite.simulation.run import simulate_rank
from megalite.run import Run


def ranks_to_simulate(spec: str, world_size: int) -> list[int]:
    """``--simulate-rank``: ranks separated by commas, or every rank ('all')."""
    return list(range(world_size)) if spec == "all" else [int(rank) for rank in spec.split(",")]


def _group_sizes(layout: Layout, world_size: int) -> dict[str, int]:
    """Each group kind's size and (``KIND_span``) the consecutive ranks its ring spans, as the planner prices it."""
    tp, cp, dp, ep = layout.tp, layout.cp, layout.dp, layout.ep
    return {"tensor": tp, "pipeline": layout.pp, "context": cp, "data": dp, "data_context": layout.replicas,
            "expert": ep, "expert_data": layout.expert_dp, "model": tp * layout.pp, "embedding": 2, "world": world_size,
            "context_span": tp * cp, "data_span": tp * dp, "data_context_span": tp * dp * cp,
            "expert_span": tp * ep, "expert_data_span": tp * dp * cp, "model_span": world_size,
            "intra_instance": layout.shard_replicas, "intra_instance_span": tp * layout.shard_replicas,
            "inter_instance": layout.instances, "inter_instance_span": tp * dp * cp}


def _planned_step(cfg: MegaliteConfig, layout: Layout, hardware: Hardware) -> StepTime:
    model = cfg.model   # a resolved run's: its vocabulary is the tokenizer's (megalite.run)
    return step_time(model, layout, hardware, cfg.training.global_batch_size, dtype_bytes=dtype_bytes(cfg))


def simulate_job(run: Run) -> tuple[list[str], list[str]]:
    """Simulate the ranks the run asks for; (the lines to print, one line per broken rule)."""
    cfg = run.cfg
    t = cfg.training
    world = run.dims.world
    layout, stages = run_memory(cfg, world, cuda=True)
    name, memory_gib = report.DEVICES[t.simulate_device]
    hardware = Hardware(num_gpus=world, gpus_per_node=min(8, world), gpu_memory_gib=memory_gib)
    planned_step, sizes = _planned_step(cfg, layout, hardware), _group_sizes(layout, world)
    planned = {stage.pp_rank: stage for stage in stages}
    ranks = ranks_to_simulate(t.simulate_rank, world)
    lines, errors, reports = [], [], []
    start = time.perf_counter()
    for rank in ranks:
        try:
            result = simulate_rank(run, rank)
        except Exception as error:   # noqa: BLE001 - every broken rule becomes its line; the ranks after it still run
            errors.append(f"rank {rank}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            continue
        reports.append(result)
        stage = planned[result.coordinates["pp"]]
        if len(ranks) == 1:
            c = result.coordinates
            lines.append(f"megalite: simulated rank {rank} of {world} (TP rank {c['tp']}, CP rank {c['cp']}, DP rank "
                         f"{c['dp']}, PP rank {c['pp']}), two iterations on {name}:")
            lines += report.memory_lines(result, stage)
            lines += report.communication_lines(result, sizes, planned_step, hardware)
            lines += report.host_read_lines(result)
        else:
            lines.append(f"  rank {rank:>5} (PP rank {result.coordinates['pp']}): peak {result.peak_bytes / 2**30:.3f} "
                         f"GiB, planned {stage.total / 2**30:.3f} GiB ({result.peak_bytes / stage.total:.3f})")
    if reports:
        if len(ranks) > 1:
            worst = max(reports, key=lambda r: r.peak_bytes)
            lines.append(f"the most loaded rank, {worst.rank}:")
            lines += report.memory_lines(worst, planned[worst.coordinates["pp"]])
            lines += report.communication_lines(worst, sizes, planned_step, hardware)
            lines += report.host_read_lines(worst)
        lines.append(report.summary_line(reports, planned, t.simulate_device)
                     + f" ({time.perf_counter() - start:.1f} s)")
    return lines, errors

