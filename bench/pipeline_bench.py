"""Benchmark: megalite's pipeline engine against torch.distributed.pipelining, same model, same data, one launch.

    torchrun --nproc_per_node 4 bench/pipeline_bench.py [--iters N] [--warmup W] [--micro-batches M] ...

What is compared
    For each layout (default: PP=4 x V=1 x DP=1 and PP=2 x V=2 x DP=2 under 1F1B, then PP=4 zero-bubble, PP=2 x V=2
    zero-bubble and PP=2 zbv, x DP=2 where it fits) both sides run the forward and backward of one global batch
    through the same pipeline-rank chunks of a megalite ``GPTModel`` (TP=1, dropout 0, fp32):

    - ours:  ``megalite.pipeline.run_schedule`` over ``build_schedule`` (1f1b: 1F1B, or interleaved 1F1B for V > 1;
             zero-bubble: ZB-H1, interleaved for V > 1; zbv: ZB-V on the v-shape placement), with the weight
             gradients of the zero-bubble schedules deferred to their W steps (``WeightGradStore``) and
             ``PipelineLinks``, driven by a ``forward_step`` written like ``Trainer.train_step``'s;
    - torch: ``PipelineStage`` around the very same kind of chunk (one stage per chunk, at the stage index
             ``chunks_of_rank`` gives it) under ``Schedule1F1B`` (V=1) or ``ScheduleInterleaved1F1B`` (V>1) for
             1f1b, ``ScheduleInterleavedZeroBubble`` for zero-bubble (torch's ZB1P, split backward through autograd)
             and ``ScheduleZBVZeroBubble`` for zbv, with ``scale_grads=False`` and a ``loss_fn`` computing the same
             per-token cross entropy.

    Both sides build their chunks from the same seed (layout-independent init), read the same mock-data samples, and
    normalise each micro-batch's summed token loss by the global batch's token count, so both backpropagate the
    gradient of the same global-batch mean loss. The first iteration of each side is checked against the other: the
    loss and every gradient on every rank are printed as relative differences. Both sides run the same ops in the
    same order, so on CPU they come out bit-identical (0.0); anything above ~1e-6 means the comparison is off
    (scaling one side's loss by 1 + 1e-5 shows up as 1e-5 in both numbers).

How it is timed
    Only forward + backward of one global batch is timed, on both sides: no optimizer step, no gradient clipping, and
    no gradient reduction (neither the DP all-reduce nor the tied-embedding all-reduce between first and last stage;
    torch's pipelining does not do them either for a plain module). With DP=2 each DP replica runs its own pipeline
    concurrently, so the step time includes the contention of two pipelines on the machine, for both sides alike.
    Each timed iteration starts after a world barrier; its time is the maximum over ranks of the per-rank wall time
    (the pipeline is done when its slowest rank is). Ours and torch's iterations alternate, so drift in machine load
    hits both sides equally. The first --warmup iterations of each side are not timed (torch's first one also runs
    its shape inference). Reported: mean and standard deviation over --iters iterations, and as the ratio the median
    of the per-iteration ratios ours_i / torch_i of neighbouring (in time) iterations, which is robust to other load
    on the machine coming and going (the 1-minute load average at start and end is printed to flag that).

Memory of sent outputs
    Our engine frees each sent activation's data once its send completes, keeping the graph for the backward. The
    table shows, per rank and averaged over ranks, the activation bytes freed per step and the output bytes still
    held after a step (sends not yet completed), averaged over the steps and at their most, against what keeping
    every output until its backward would hold. A send completes only once its receiver has taken the message, so
    with more ranks than cores, where a rank waits for the CPU, outputs stay longer than on a GPU.

The bubble
    Our ``ScheduleStats.idle_fraction`` is 1 - busy / total per rank (busy = time inside forward/backward compute,
    total = wall time of the schedule), averaged over all ranks. The textbook bubble (PP-1)/(V*M) (Narayanan et al.
    2021) is the bubble time relative to the *ideal* (busy) time, not to the total, so the table shows both our
    idle/total (= idle_fraction) and idle/busy = (total - busy) / busy, each averaged over ranks and iterations; the
    latter is the one to hold against (PP-1)/(V*M) (as idle/total the theory is (PP-1)/(V*M + PP-1)). The schedules
    themselves reach the theory exactly: a unit-cost simulation of build_schedule's orderings (F = 1/V, B = 2/V, free
    transfers) gives idle/busy = (PP-1)/(V*M). With more ranks than cores (4 ranks on 2 cores), "busy" includes time
    a rank was runnable but descheduled, and an idle rank hands its core to a busy one, so the measured bubble is only
    indicative there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

# Benchmark the checkout this script lives in, not whatever ``megalite`` the environment has installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from megalite import parallel_state
from megalite.config import ModelConfig
from megalite.data import MockGPTDataset, micro_batch_indices
from megalite.model import GPTModel
from megalite.pipeline import (PipelineLinks, build_schedule, chunks_of_rank, placement_of, plan_transfers,
                               run_schedule, schedule_bubble, splits_backward)
from megalite.tensor_parallel import (TensorParallelRNG, WeightGradStore, attach_weight_grad_store,
                                      vocab_parallel_cross_entropy)

from common import timed as common_timed, world_max, world_sum

CPU = torch.device("cpu")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per side and layout")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per side and layout (>= 1)")
    parser.add_argument("--micro-batches", type=int, default=8, help="M, micro-batches per pipeline per step")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--layouts", default="4x1,2x2,4x1:zero-bubble,2x2:zero-bubble,2x2:zbv",
                        help="comma-separated PPxV[:schedule] (schedule 1f1b, zero-bubble or zbv; default 1f1b); "
                             "DP = world size / PP")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: the first iteration is the correctness check")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Model and data, identical for both sides
# ---------------------------------------------------------------------------------------------------------------------

def build_chunks(cfg: ModelConfig, pp: int, v: int, pp_rank: int, seed: int,
                 placement: str = "round-robin") -> list[GPTModel]:
    """This pipeline rank's V model chunks, initialised from ``seed`` (the same values every time it is called)."""
    rng = TensorParallelRNG(seed, 0, pp_rank, CPU)   # only used by attention dropout, which is off
    chunks = []
    for c in chunks_of_rank(cfg.num_layers, pp, v, pp_rank, placement):
        chunk = GPTModel(cfg, rng, pre_process=c.is_first, post_process=c.is_last, layer_offset=c.first_layer,
                         num_layers=c.num_layers)
        chunk.initialize(seed)
        chunk.train()
        chunks.append(chunk)
    return chunks


def global_batch(cfg: ModelConfig, args, dp_rank: int, dp: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(tokens, labels) per micro-batch of this DP rank, for the first global batch, as the Trainer reads them."""
    dataset = MockGPTDataset(cfg.vocab_size, cfg.seq_length, args.seed)
    indices = micro_batch_indices(0, args.micro_batch_size, args.micro_batches, dp_rank, dp)
    samples = [torch.stack([dataset[i] for i in batch]) for batch in indices]
    return [s[:, :-1].contiguous() for s in samples], [s[:, 1:].contiguous() for s in samples]


def zero_grads(chunks: list[GPTModel]) -> None:
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------------------------------
# The two engines
# ---------------------------------------------------------------------------------------------------------------------

class Ours:
    """megalite's engine: the schedule the Trainer would build, run by run_schedule over PipelineLinks."""

    def __init__(self, chunks, cfg: ModelConfig, args, pp: int, v: int, pp_rank: int, tokens, labels,
                 global_tokens: float, schedule: str = "1f1b"):
        self.chunks, self.pp, self.v, self.pp_rank = chunks, pp, v, pp_rank
        self.tokens, self.labels, self.global_tokens = tokens, labels, global_tokens
        steps = [build_schedule(pp, r, args.micro_batches, v, schedule) for r in range(pp)]
        self.plan = plan_transfers(steps, pp, v, placement_of(schedule))[pp_rank]
        self.weight_grads = WeightGradStore() if splits_backward(steps[pp_rank]) else None
        for chunk in chunks:
            attach_weight_grad_store(chunk, self.weight_grads)
        self.links = PipelineLinks(parallel_state.get_pipeline_model_parallel_group(),
                                   (args.micro_batch_size, cfg.seq_length, cfg.hidden_size), torch.float32, CPU)

    def step(self):
        """(ScheduleStats, this rank's share of the global-batch loss: nonzero only where the last stage is)."""
        loss_sums = []

        def forward_step(chunk_index: int, micro_batch: int, input_tensor):
            # As Trainer.train_step: the last chunk returns per-token losses (labels given), summed and divided by
            # the global token count; the Trainer's all-ones loss mask is left out (torch's side has none either).
            chunk = self.chunks[chunk_index]
            output = chunk(self.tokens[micro_batch] if chunk.pre_process else input_tensor,
                           self.labels[micro_batch] if chunk.post_process else None)
            if not chunk.post_process:
                return output
            loss_sum = output.sum()
            loss_sums.append(loss_sum.detach())
            return loss_sum / self.global_tokens

        stats = run_schedule(self.plan, forward_step, self.links, weight_grads=self.weight_grads)
        loss = float(sum(loss_sums)) / self.global_tokens if loss_sums else 0.0
        return stats, loss


class Torch:
    """torch.distributed.pipelining: one PipelineStage per chunk under the schedule matching ours, no grad
    scaling."""

    def __init__(self, chunks, cfg: ModelConfig, args, pp: int, v: int, pp_rank: int, tokens, labels,
                 global_tokens: float, schedule: str = "1f1b"):
        self.chunks = chunks
        group = parallel_state.get_pipeline_model_parallel_group().group
        # GPTModel.forward(x) already takes token ids on the first chunk and hidden states elsewhere, and returns
        # logits on the last chunk (no labels passed), so it serves as the stage module without a wrapper.
        self.stages = [PipelineStage(chunk, stage.virtual_stage, pp * v, CPU, group=group)
                       for chunk, stage in zip(chunks, chunks_of_rank(cfg.num_layers, pp, v, pp_rank,
                                                                      placement_of(schedule)))]
        vocab = cfg.vocab_size

        def loss_fn(logits, target):
            # The same per-token loss as our last chunk computes (padded vocab columns masked), same normalisation.
            return vocab_parallel_cross_entropy(logits, target, vocab).sum() / global_tokens

        if schedule == "zbv":
            self.schedule = ScheduleZBVZeroBubble(self.stages, args.micro_batches, loss_fn=loss_fn,
                                                  scale_grads=False)
        elif schedule == "zero-bubble":
            self.schedule = ScheduleInterleavedZeroBubble(self.stages, args.micro_batches, loss_fn=loss_fn,
                                                          scale_grads=False)
        elif v == 1:
            self.schedule = Schedule1F1B(self.stages[0], args.micro_batches, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = ScheduleInterleaved1F1B(self.stages, args.micro_batches, loss_fn=loss_fn,
                                                    scale_grads=False)
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        # torch splits the whole batch along dim 0 into M equal chunks, in order: micro-batch m is rows m*b..(m+1)*b,
        # the same samples as our micro-batch m.
        self.tokens, self.labels = torch.cat(tokens), torch.cat(labels)

    def step(self):
        losses: list[torch.Tensor] = []
        args = (self.tokens,) if self.has_first else ()
        kwargs = dict(target=self.labels, losses=losses) if self.has_last else {}
        # return_outputs=False: we keep no logits either.
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return None, float(sum(l.detach() for l in losses)) if losses else 0.0


# ---------------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------------

def grads_of(chunks) -> list[torch.Tensor]:
    grads = [p.grad for chunk in chunks for p in chunk.parameters()]
    if any(g is None for g in grads):   # would otherwise compare zeros with zeros and pass
        raise RuntimeError(f"rank {dist.get_rank()}: a parameter got no gradient")
    return [g.detach().clone() for g in grads]


def max_relative_grad_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max over parameters of max|a - b| / max|a|: a relative error per tensor, worst tensor wins."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        scale = float(x.abs().max())
        if scale > 0:
            worst = max(worst, float((x - y).abs().max()) / scale)
        elif float(y.abs().max()) > 0:
            worst = float("inf")
    return worst


def timed(side):
    """One step of ``side`` started together on all ranks: (max over ranks of wall seconds, stats, loss share)."""
    seconds, (stats, loss) = common_timed(side.step)
    return seconds, stats, loss


def bench_layout(args, pp: int, v: int, schedule: str = "1f1b") -> dict:
    world = dist.get_world_size()
    if world % pp:
        raise SystemExit(f"world size {world} is not divisible by PP {pp}")
    dp = world // pp
    parallel_state.initialize_model_parallel(1, pp)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    cfg = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                      vocab_size=args.vocab_size, hidden_dropout=0.0, attention_dropout=0.0)
    tokens, labels = global_batch(cfg, args, dp_rank, dp)
    global_tokens = float(dp * args.micro_batches * args.micro_batch_size * args.seq_length)

    # Two independent copies of the same weights, so each side's gradients can be compared with the other's.
    placement = placement_of(schedule)
    ours = Ours(build_chunks(cfg, pp, v, pp_rank, args.seed, placement), cfg, args, pp, v, pp_rank, tokens, labels,
                global_tokens, schedule)
    theirs = Torch(build_chunks(cfg, pp, v, pp_rank, args.seed, placement), cfg, args, pp, v, pp_rank, tokens,
                   labels, global_tokens, schedule)

    # Correctness first: one step each from zero gradients, then compare loss and gradients.
    zero_grads(ours.chunks)
    zero_grads(theirs.chunks)
    _, _, loss_ours = timed(ours)
    _, _, loss_torch = timed(theirs)
    loss_ours, loss_torch = world_sum([loss_ours, loss_torch])   # last stages of every DP replica: global mean
    grad_diff = world_max(max_relative_grad_difference(grads_of(ours.chunks),
                                                       grads_of(theirs.chunks)))

    # Remaining warm-up, then timed iterations, alternating sides.
    times = {"ours": [], "torch": []}
    idle, idle_per_busy, memory = [], [], []
    budget_s, spent = getattr(args, "budget_s", None), 0.0   # run_all's time limit (same decision on every rank)
    for i in range(args.warmup - 1 + args.iters):
        if budget_s is not None and len(times["ours"]) >= 5 and spent > budget_s:
            break
        for name, side in (("ours", ours), ("torch", theirs)):
            zero_grads(side.chunks)
            seconds, stats, _ = timed(side)
            if i < args.warmup - 1:
                continue
            times[name].append(seconds)
            spent += seconds
            if stats is not None:
                # Average the per-rank idle fractions over all ranks (every pipeline rank of every DP replica).
                span = world_max(stats.total_s)   # the pipeline is done when its slowest rank is
                frac, per_busy = world_sum([1 - stats.busy_s / span, (span - stats.busy_s) / stats.busy_s])
                idle.append(frac / world)
                idle_per_busy.append(per_busy / world)
                held, kept = zip(*stats.output_bytes)
                memory.append([x / world for x in world_sum([stats.freed_bytes, statistics.mean(held),
                                                             statistics.mean(kept), max(held), max(kept)])])

    parallel_state.destroy_model_parallel()
    return {"pp": pp, "v": v, "dp": dp, "m": args.micro_batches, "schedule": schedule, "loss_ours": loss_ours,
            "loss_torch": loss_torch, "grad_diff": grad_diff, "ours_ms": [t * 1e3 for t in times["ours"]],
            "torch_ms": [t * 1e3 for t in times["torch"]], "idle": statistics.mean(idle),
            "idle_per_busy": statistics.mean(idle_per_busy), "theory": schedule_bubble(schedule, pp,
                                                                                      args.micro_batches, v),
            **{key: statistics.mean(m[i] for m in memory) / 2**20 for i, key in enumerate(
                ("freed_mib", "held_mib", "kept_mib", "held_peak_mib", "kept_peak_mib"))}}


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):7.1f} ± {std:5.1f}"


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)   # 4 ranks on 2 cores: intra-op threads would only fight each other
    rank0 = dist.get_rank() == 0
    layouts = []
    for item in args.layouts.split(","):
        shape, _, schedule = item.partition(":")
        layouts.append((*(int(x) for x in shape.lower().split("x")), schedule or "1f1b"))
    if rank0:
        print(f"GPT {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
              f"seq {args.seq_length}, vocab {args.vocab_size}; micro-batch {args.micro_batch_size}, "
              f"M={args.micro_batches} per pipeline; fp32, dropout 0, TP=1; {dist.get_world_size()} ranks, "
              f"{torch.get_num_threads()} thread each, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}",
              flush=True)
    results = []
    for pp, v, schedule in layouts:
        wall = time.perf_counter()
        result = bench_layout(args, pp, v, schedule)
        results.append(result)
        if rank0:
            rel = abs(result["loss_ours"] - result["loss_torch"]) / abs(result["loss_torch"])
            print(f"PP={pp} V={v} DP={result['dp']} {schedule}: first-step loss ours {result['loss_ours']:.8f} torch "
                  f"{result['loss_torch']:.8f} (rel diff {rel:.1e}); max rel grad diff {result['grad_diff']:.1e} "
                  f"({time.perf_counter() - wall:.0f} s)", flush=True)

    if rank0:
        print(f"\nforward+backward of one global batch, no optimizer step, no DP / tied-embedding grad reduction "
              f"(both sides); ms: mean ± std over {args.iters} iterations after {args.warmup} warm-up")
        header = (f"{'schedule':>11} {'PP':>3} {'V':>2} {'DP':>3} {'M':>3} | {'ours ms/step':>15} | "
                  f"{'torch ms/step':>15} | {'ours/torch*':>11} | {'bubble idle/total':>17} {'idle/busy':>9} | "
                  f"{'theory':>6} | {'freed MiB':>9} {'held/kept MiB mean':>18} {'peak':>11}")
        print(header)
        print("-" * len(header))
        for r in results:
            ratio = statistics.median(o / t for o, t in zip(r["ours_ms"], r["torch_ms"]))
            print(f"{r['schedule']:>11} {r['pp']:>3} {r['v']:>2} {r['dp']:>3} {r['m']:>3} | "
                  f"{mean_std(r['ours_ms']):>15} | {mean_std(r['torch_ms']):>15} | {ratio:>11.3f} | "
                  f"{r['idle']:>17.3f} {r['idle_per_busy']:>9.3f} | {r['theory']:>6.3f} | {r['freed_mib']:>9.2f} "
                  f"{r['held_mib']:>8.2f} / {r['kept_mib']:<7.2f} {r['held_peak_mib']:>5.2f} / {r['kept_peak_mib']:<5.2f}")
        print(f"* median of per-iteration ratios. Bubble: ours only (ScheduleStats), idle up to the slowest rank's "
              f"end, averaged over ranks; idle/busy is the measure comparable with the theory at equal F/B/W costs "
              f"((PP-1)/(V*M) for 1f1b, a third of it for zero-bubble, (PP-1)/(6M) for zbv). Memory of sent outputs "
              f"per rank: freed per step; held after a step (mean over steps, and most) against what keeping each until its "
              f"backward would hold. "
              f"DP>1 runs DP pipelines side by side (DP x the work per step). Load average at end "
              f"{os.getloadavg()[0]:.1f}.")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
