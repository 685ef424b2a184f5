"""Mixture of experts side by side: the all-to-all dispatcher against the all-gather one, and grouped expert products
(torch._grouped_mm) against the loop over experts, as ratios; and the tokens' communication per step against the
analytic volume.

    torchrun --nproc_per_node 4 bench/moe_bench.py [--iters 8] [--experts 8] [--topk 2]

Every side trains the same GPT with every MLP a mixture of experts (fp32, dropout off, same initial weights and
data) at EP = world size (DP = EP: each rank holds E / EP experts and routes its own micro-batches), one step being
forward + backward over the micro-batches + the two engines' gradient reductions + the optimizer step. The sides take
turns step by step (bench/common.py) and each ratio is the median of per-round ratios, so the machine's other load
cancels out as much as it can; on a shared CPU absolute times mean little. Communication: one step of each
dispatcher under bench/comm_counter.py, the hidden-sized all-to-alls (or all-gathers and reduce-scatters) against
4 k T h per MoE layer and micro-batch (alltoall: every (token, expert) row sent, forward and backward, its own
rank's share included) or 4 EP T h (allgather: gathered tensors and reduce-scatter inputs are counted whole).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist

import common
from comm_counter import count_communication
from megalite import parallel_state
from megalite.model.experts import grouped_mm_available
from megalite.planner import Layout
from megalite.planner.performance import all_to_all_bytes
from megalite.training import Trainer

SIDES = {"alltoall, looped experts": ("alltoall", False), "allgather, looped experts": ("allgather", False),
         "alltoall, grouped experts": ("alltoall", True)}


def moe_config(args, dispatcher: str, grouped: bool):
    ep = dist.get_world_size()
    cfg = common.training_config(args, micro_batches=args.micro_batches, dp=ep)
    model = dataclasses.replace(cfg.model, num_experts=args.experts, moe_router_topk=args.topk,
                                moe_ffn_hidden_size=args.expert_hidden, moe_aux_loss_coeff=1e-2,
                                moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped)
    return dataclasses.replace(cfg, model=model,
                               parallel=dataclasses.replace(cfg.parallel, expert_model_parallel_size=ep))


def counted_step(trainer: Trainer, micro_batch: int) -> tuple[float, dict[str, int]]:
    """One step under the communication counter: (loss, elements of the token rows' collectives per kind, summed over
    ranks): the all-to-alls of hidden-sized rows (a rank sends any number of them; its E row counts are not), the
    all-gathers and reduce-scatters of EP T such rows (the routing weights and map gathered beside them, E wide, are
    not)."""
    m, ep = trainer.cfg.model, dist.get_world_size()
    gathered = ep * micro_batch * m.seq_length * m.hidden_size
    wanted = {"all_to_all_single": lambda size: size % m.hidden_size == 0, "all_gather": gathered.__eq__,
              "reduce_scatter": gathered.__eq__}
    with count_communication() as counter:
        loss = trainer.train_step()["loss"]
    local = [sum(n * size for (op, _, size), n in counter.by_size.items() if op == kind and wanted[kind](size))
             for kind in wanted]
    return loss, dict(zip(wanted, common.world_sum(local)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank per step")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--expert-hidden", type=int, default=512)
    common.add_model_arguments(parser)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    common.set_threads(dist.get_world_size())
    ep = dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    trainers = {label: Trainer.on_registered_layout(moe_config(args, *side), common.CPU) for label, side in SIDES.items()}
    counts = {label: counted_step(trainer, args.micro_batch) for label, trainer in trainers.items()}   # step 1
    times = common.alternate({label: lambda t=t: t.train_step() for label, t in trainers.items()},
                             args.warmup - 1, args.iters)

    if dist.get_rank() == 0:
        cfg = trainers["alltoall, looped experts"].cfg
        m = cfg.model
        tokens = args.micro_batch * m.seq_length
        moe_layers = sum(m.moe_layers())
        print(f"\nEP={ep} (= DP), GPT {m.num_layers} layers x hidden {m.hidden_size}, every MLP {m.num_experts} "
              f"experts of {m.expert_ffn_size}, top-{m.moe_router_topk}, seq {m.seq_length}, micro-batch "
              f"{args.micro_batch} x {args.micro_batches} per rank, fp32, CPU/gloo (load {common.load_average():.1f}"
              f"); grouped products {'available' if grouped_mm_available(*_probe(m)) else 'NOT available'}; "
              f"first-step losses {sorted(set(f'{loss:.6f}' for loss, _ in counts.values()))}")
        base = times["alltoall, looped experts"]
        print(f"{'side':<28} {'ms/step':>9} {'vs alltoall looped*':>20}")
        for label in SIDES:
            print(f"{label:<28} {statistics.median(times[label]):9.1f} {common.paired_ratio(times[label], base):20.3f}")
        print("* median of per-round ratios")
        per_layer = {"alltoall": 4 * m.moe_router_topk * tokens * m.hidden_size,
                     "allgather": 4 * ep * tokens * m.hidden_size}
        for label, (dispatcher, _) in list(SIDES.items())[:2]:
            counted = counts[label][1]
            moved = counted["all_to_all_single"] if dispatcher == "alltoall" else (counted["all_gather"] +
                                                                                  counted["reduce_scatter"])
            analytic = per_layer[dispatcher] * moe_layers * args.micro_batches * ep
            others = all_to_all_bytes(dataclasses.replace(m, moe_token_dispatcher_type=dispatcher),
                                      Layout(dp=ep, ep=ep, micro_batch_size=args.micro_batch), args.micro_batches, 4)
            print(f"{dispatcher} dispatch, one step, all ranks: {moved:,.0f} hidden-sized elements counted, analytic "
                  f"{analytic:,} (ratio {moved / analytic:.3f}); the planner's bytes leaving each rank: "
                  f"{others / 2**20:.2f} MiB")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _probe(model):
    import torch

    return torch.empty(1, model.hidden_size), [model.hidden_size, 2 * model.expert_ffn_size if model.swiglu
                                               else model.expert_ffn_size, model.expert_ffn_size]


if __name__ == "__main__":
    main()
