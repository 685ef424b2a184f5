"""Context parallelism on the CPU at sequence length 2048: CP=2 against CP=1 x DP=2 on the same 2 ranks, and how much
of the ring's communication hides behind its attention blocks.

    torchrun --nproc_per_node 2 bench/cp_bench.py [--seq 2048] [--iters 6] [--comm-types p2p,a2a,allgather]

Both sides train the same GPT on the same global batch (2 samples of --seq tokens per step; fp32, dropout off, same
initial weights): CP=1 x DP=2 gives each rank one whole sample, CP=2 gives each rank half the tokens of both (two
micro-batches). Steps alternate between the sides (bench/common.py: barrier-started, max over ranks, median of
per-round ratios); absolute times on a shared CPU mean little.

- Step time: CP=2 / CP=1 x DP=2, per comm type.
- Memory per rank: what autograd keeps for backward over one micro-batch's forward (saved-tensor hooks, as
  tests/activation_memory.py counts it), the peak of activations under gradient accumulation. Model states are the
  same on both sides (CP ranks hold the whole model, as DP ranks do), so they are left out of the ratio.
- The ring's overlap: each ring exchange is started before its block's compute and waited for after it. The time
  spent waiting is measured inside the training step, and set against the time the same exchanges take alone
  (measured separately, nothing else running): hidden = 1 - waited / alone.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

import common
from megalite import parallel_state
from megalite.model import context_parallel
from megalite.training import Trainer


def build_layout(cp: int) -> parallel_state.ParallelState:
    """A registered layout of the world taken back out of the registry, so that two can take turns."""
    state = parallel_state.initialize_model_parallel(1, 1, context_parallel_size=cp)
    parallel_state._STATE = None   # noqa: SLF001 - the bench swaps registered layouts between alternating steps
    return state


@contextlib.contextmanager
def registered(state: parallel_state.ParallelState):
    previous, parallel_state._STATE = parallel_state._STATE, state   # noqa: SLF001
    try:
        yield
    finally:
        parallel_state._STATE = previous   # noqa: SLF001


def activation_bytes(trainer: Trainer) -> int:
    """Bytes autograd keeps for one micro-batch's forward on this rank (distinct storages, parameters excluded)."""
    batch = trainer.micro_batches(trainer.samples(trainer.data.train, 0, 1))[0]   # the step's own data
    parameters = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = trainer.model[0](batch.inputs, batch.labels, batch.shard).sum()
    del loss
    return sum(storages.values())


class RingWaits:
    """Seconds spent waiting for ring exchanges to complete (context_parallel._finish), while counting."""

    def __init__(self):
        self.seconds, self.count = 0.0, 0
        self._original = context_parallel._finish   # noqa: SLF001

    @contextlib.contextmanager
    def counting(self):
        def timed(exchange):
            start = time.perf_counter()
            result = self._original(exchange)
            self.seconds += time.perf_counter() - start
            self.count += 1
            return result

        context_parallel._finish = timed   # noqa: SLF001
        try:
            yield self
        finally:
            context_parallel._finish = self._original   # noqa: SLF001


def exchange_alone_seconds(shape: tuple[int, ...], dtype: torch.dtype, repeats: int = 10) -> float:
    """Seconds of one ring exchange of a tensor of ``shape`` with nothing else running (median of ``repeats``)."""
    group = parallel_state.get_context_parallel_group()
    tensor = torch.randn(shape).to(dtype)
    times = []
    for _ in range(repeats):
        common.barrier()
        start = time.perf_counter()
        context_parallel._finish(context_parallel._start_ring_exchange(tensor, group, 0))   # noqa: SLF001
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_arguments(parser)
    parser.set_defaults(seq=2048, layers=2, hidden=128, heads=4, micro_batch=1)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--comm-types", default="p2p,a2a,allgather")
    parser.add_argument("--output", default=None, help="also write the table to this file")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("cp_bench.py runs on 2 ranks: torchrun --nproc_per_node 2 bench/cp_bench.py")
    threads = common.set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "2")))
    layouts = {"CP=1 x DP=2": build_layout(1), "CP=2": build_layout(2)}
    base = common.training_config(args, micro_batches=1, dp=2)   # global batch 2 x micro-batch

    def trainer(name: str, comm_type: str) -> Trainer:
        cfg = base
        if name == "CP=2":
            cfg = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, context_parallel_size=2,
                                                                         cp_comm_type=comm_type))
        with registered(layouts[name]):
            return Trainer.on_registered_layout(cfg, common.CPU)

    lines = [f"Context parallelism on {threads} thread(s) per rank, 2 ranks: GPT {args.layers} x {args.hidden} "
             f"({args.heads} heads), sequence {args.seq}, global batch {2 * args.micro_batch}, fp32; load average "
             f"{common.load_average():.1f} at the start (ratios: median of {args.iters} alternating rounds)", "",
             "| comm type | step time CP=2 / CP=1 x DP=2 (IQR) | activation bytes per rank CP=2 / CP=1 | "
             "ring exchanges hidden behind compute |", "|---|---|---|---|"]
    for comm_type in args.comm_types.split(","):
        trainers = {name: trainer(name, comm_type) for name in layouts}

        def step(name, trainers=trainers):
            def run():
                with registered(layouts[name]):
                    trainers[name].train_step()
            return run

        times = common.alternate({name: step(name) for name in layouts}, args.warmup, args.iters)
        ratio = common.paired_ratio(times["CP=2"], times["CP=1 x DP=2"])
        low, high = common.ratio_spread(times["CP=2"], times["CP=1 x DP=2"])
        held = {}
        for name in layouts:
            with registered(layouts[name]):
                held[name] = common.world_max(activation_bytes(trainers[name]))
        hidden = "-"
        if comm_type == "p2p":
            with registered(layouts["CP=2"]):
                waits = RingWaits()
                with waits.counting():
                    trainers["CP=2"].train_step()
                hidden = hidden_fraction(trainers["CP=2"], waits, args)
        lines.append(f"| {comm_type} | {ratio:.2f} ({low:.2f}-{high:.2f}) | "
                     f"{held['CP=2'] / held['CP=1 x DP=2']:.3f} ({held['CP=2'] / 2**20:.1f} / "
                     f"{held['CP=1 x DP=2'] / 2**20:.1f} MiB) | {hidden} |")
        if common.rank() == 0:
            medians = {name: f"{statistics.median(t):.0f}" for name, t in times.items()}
            print(f"{comm_type}: median step ms {medians}", flush=True)
        del trainers
    lines += ["", "The ring's exchanges are started before each block's compute and waited for after it. Waiting "
              "covers the transfer and any wait for the peer; on CPU ranks sharing cores, gloo's transfer threads "
              "compete with the compute for them, so what is hidden is whatever the measurement says, not what a GPU "
              "with its copy engines would hide. a2a's core is SDPA's fused kernel on the whole sequence; the ring's "
              "blocks are torch's fused CPU flash kernel, one call per block plus the merges of their softmaxes."]
    common.print_table(lines, args.output)
    for state in layouts.values():
        with registered(state):
            parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def hidden_fraction(trainer: Trainer, waits: RingWaits, args) -> str:
    """1 - (time waited for the ring's exchanges in a step) / (the same exchanges alone): the share that overlapped
    with the attention blocks' compute."""
    m = trainer.cfg.model
    local = m.seq_length // 2
    kv_shape = (2, args.micro_batch, m.num_attention_heads, local, m.head_dim)
    # Per layer and micro-batch at CP=2: forward one K/V exchange; backward one K/V and two dK/dV (fp32) exchanges.
    per_layer = 2 * exchange_alone_seconds(kv_shape, torch.float32) + 2 * exchange_alone_seconds(kv_shape,
                                                                                               torch.float32)
    alone = per_layer * m.num_layers * trainer.num_micro_batches
    waited = common.world_max(waits.seconds)
    return (f"{max(0.0, 1 - waited / alone):.0%} (waited {waited * 1e3:.1f} ms of {alone * 1e3:.1f} ms alone, "
            f"{waits.count} exchanges)")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
