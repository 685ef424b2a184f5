"""ZeRO-3 (FSDP2) against ZeRO-1 (our distributed optimizer) at DP=4: step time, bytes per rank, and communication per
step against the ZeRO paper's 2x (stages 1-2) and 3x (stage 3) the parameters.

    torchrun --nproc_per_node 4 bench/zero3_bench.py [--iters 6] [--hidden 256] [--layers 4] [--output FILE]

Both sides train the same GPT (fp32, dropout off, same initial weights and batches) with the same AdamW, for M = 1
and M = 2 micro-batches per rank per step. Steps alternate between the sides (bench/common.py) and the time ratio is
the median of per-round ratios; absolute times on a shared CPU mean little.

Communication is counted at the torch.distributed calls (bench/comm_counter.py) on the data-parallel group, in
elements, as the whole tensor of a reduce-scatter (its input) or all-gather (its output), so the ZeRO paper's
"2 Psi" for stages 1-2 is one reduce-scatter of the gradients plus one all-gather of the parameters, and its "3 Psi"
for stage 3 is an all-gather in forward, another in backward and a reduce-scatter. Two effects of FSDP2 show in the
measured numbers: the root unit (embeddings, final norm, output layer) stays gathered from forward to backward, so
its parameters are gathered once per micro-batch, not twice (less than 3x); and every micro-batch gathers and
reduce-scatters again (about 3M x instead of 3x), which is the price of never holding a whole gradient.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist

import common
from comm_counter import count_communication
from megalite import parallel_state
from megalite.training import Trainer


def held_bytes(trainer: Trainer) -> list[float]:
    """(parameter, gradient, optimizer-state) bytes this rank holds."""
    return [float(b) for b in (*trainer.engine.held_bytes(), trainer.optimizer.state_bytes())]


def data_parallel_elements(trainer: Trainer) -> dict[str, int]:
    """Elements each collective moves on the data-parallel group in one training step (this rank's calls)."""
    with count_communication() as counter:
        trainer.train_step()
    return {op: counter.elements(op, "data") for op in ("all_reduce", "reduce_scatter", "all_gather")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_model_arguments(parser)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", default=None, help="also write the table to this file")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    common.set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
    dp = dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1)
    lines = [f"ZeRO-3 (FSDP2) vs ZeRO-1 (distributed optimizer), DP={dp}, hidden {args.hidden}, {args.layers} layers, "
             f"seq {args.seq}, micro-batch {args.micro_batch}, fp32 (ratios: median of {args.iters} alternating "
             f"rounds)", "",
             "| M | ZeRO-3 / ZeRO-1 step time | params B/rank, 1 -> 3 | grads B/rank, 1 -> 3 | Adam B/rank, 1 -> 3 "
             "| ZeRO-1 traffic / P (RS + AG; paper 2) | ZeRO-3 traffic / P (RS + AG; paper 3M) |",
             "|---|---|---|---|---|---|---|"]
    for micro_batches in (1, 2):
        trainers = {}
        for name, options in (("ZeRO-1", {"use_distributed_optimizer": True}), ("ZeRO-3", {"zero_stage": 3})):
            cfg = common.training_config(args, micro_batches=micro_batches, dp=dp, **options)
            trainers[name] = Trainer.on_registered_layout(cfg, common.CPU)
        parameters = sum(p.numel() for p in trainers["ZeRO-1"].engine.params)
        times = common.alternate({name: t.train_step for name, t in trainers.items()}, args.warmup, args.iters)
        ratio = common.paired_ratio(times["ZeRO-3"], times["ZeRO-1"])
        held = {name: common.world_sum(held_bytes(t)) for name, t in trainers.items()}   # summed over ranks
        largest = {name: [common.world_max(v) for v in held_bytes(t)] for name, t in trainers.items()}
        traffic = {name: data_parallel_elements(t) for name, t in trainers.items()}
        cells = [f"{largest['ZeRO-1'][k] / 1e6:.2f}M -> {largest['ZeRO-3'][k] / 1e6:.2f}M "
                 f"(x DP / all ranks: {largest['ZeRO-3'][k] / held['ZeRO-3'][k] * dp:.3f})" for k in range(3)]
        for name, v in traffic.items():   # gradients all go through reduce-scatter; all-reduces carry only the
            # token count, the loss and the squared gradient norm (3 scalars)
            assert v["all_reduce"] <= 3, f"{name}: unexpected data-parallel all-reduce of {v['all_reduce']} elements"
        volume = {name: (f"{(v['reduce_scatter'] + v['all_gather']) / parameters:.3f} = "
                         f"{v['reduce_scatter'] / parameters:.3f} + {v['all_gather'] / parameters:.3f}")
                  for name, v in traffic.items()}
        lines.append(f"| {micro_batches} | {ratio:.2f} | {' | '.join(cells)} | {volume['ZeRO-1']} | "
                     f"{volume['ZeRO-3']} |")
        if common.rank() == 0:
            medians = {name: statistics.median(t) for name, t in times.items()}
            print(f"M={micro_batches}: median step ms {medians}, P = {parameters} parameters", flush=True)
        del trainers
    common.print_table(lines, args.output)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
