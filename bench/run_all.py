"""Every comparison of megalite with torch's own engines, side by side, in one command, ending in a table of ratios.

    python bench/run_all.py [--output bench/results.md] [--iters 30] [--budget-minutes 9] [--only single,tp,pp,dp]

It starts one torchrun launch per world size (1, 2 and 4 ranks; each rank gets cores / ranks threads) and runs:

1. single process: our Trainer's train_step against a plain PyTorch GPT of the same shape and maths
   (bench/reference_gpt.py: nn.Linear, nn.LayerNorm, scaled_dot_product_attention, F.cross_entropy,
   torch.optim.AdamW, clip_grad_norm_), same weights, same batch;
2. TP=2: ours against DTensor tensor parallelism (parallelize_module, ColwiseParallel/RowwiseParallel, vocab-parallel
   embedding and tied output layer with loss_parallel) on that reference model; full training steps on both sides;
3. PP=4 and PP=2 x V=2 (x DP=2 on 4 ranks): our pipeline engine against torch.distributed.pipelining's
   Schedule1F1B / ScheduleInterleaved1F1B on the same chunks (bench/pipeline_bench.py: forward + backward of one
   global batch, where the schedules differ);
4. DP=4: ours (plain, and with the distributed optimizer) against DDP and DDP + ZeroRedundancyOptimizer
   (bench/dp_bench.py: full training steps, the same GPTModel inside DDP);
5. communication per step of each layout, counted at every torch.distributed call our Trainer makes
   (bench/comm_counter.py), against the analytic minimum.

Every comparison first checks that both sides compute the same thing (first-step losses, printed), then alternates
their steps (ours, peer, peer, ours, ...: see bench/common.py) for --warmup + --iters rounds, or fewer (at least 5)
once the comparison's share of --budget-minutes is spent, which keeps the suite under 15 minutes on a loaded
machine. Ratios are ours / peer, medians of per-round ratios, with their interquartile range; below 1.0 ours is
faster. Absolute times on a shared 2-core machine are noise. The table goes to stdout and to --output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.nn.functional as F

import common
import dp_bench
import pipeline_bench
from comm_counter import FunctionalCollectiveCounter, count_communication
from megalite import parallel_state
from megalite.data import MockGPTDataset, micro_batch_indices
from megalite.model import GPTModel
from megalite.tensor_parallel import TensorParallelRNG
from megalite.training import Trainer
from reference_gpt import ReferenceGPT, clip_grad_norm_, parallelize

SECTIONS = ("single", "tp", "pp", "dp")
WORLD_OF = {"single": 1, "tp": 2, "pp": 4, "dp": 4}
SHARE = {"single": 0.08, "tp": 0.17, "pp": 0.4, "dp": 0.35}   # of --budget-minutes, by what a round costs


def budget(args, section: str) -> float:
    """Seconds of timed rounds this comparison may take (see --budget-minutes)."""
    return args.budget_minutes * 60 * SHARE[section]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.md"),
                        help="where the final table is written (as well as printed)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--iters", type=int, default=30, help="timed rounds per comparison (single process: 3x)")
    parser.add_argument("--budget-minutes", type=float, default=9.0,
                        help="time for all timed rounds together, shared out over the comparisons (a comparison "
                             "stops early, after at least 5 rounds, once its share is spent): keeps the suite under "
                             "15 minutes on a loaded machine")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per comparison (after the check step)")
    parser.add_argument("--micro-batches", type=int, default=2, help="M per step, single process and TP")
    parser.add_argument("--pp-micro-batches", type=int, default=8, help="M per pipeline per step")
    parser.add_argument("--dp-micro-batches", type=int, default=2, help="M per DP rank per step")
    common.add_model_arguments(parser)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)      # world size of a launch
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    return args


def log(*parts) -> None:
    if common.rank() == 0:
        print(*parts, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# The torch side of comparisons 1 and 2: the reference model trained the plain way
# ---------------------------------------------------------------------------------------------------------------------

class ReferenceTrainer:
    """forward/backward over the micro-batches (loss summed per token, divided by the global token count, as ours),
    clip the global gradient norm to 1, AdamW, zero the gradients. ``tensor_parallel``: the model is DTensor
    tensor-parallel, the logits are split by vocabulary and the loss runs under ``loss_parallel``."""

    def __init__(self, model: ReferenceGPT, cfg, tensor_parallel: bool = False):
        self.model, self.tensor_parallel = model, tensor_parallel
        self.optimizer = common.adamw(model.parameters())
        self.dataset = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.training.seed)
        t = cfg.training
        self.micro_batch, self.global_batch = t.micro_batch_size, t.global_batch_size
        self.num_micro = t.global_batch_size // t.micro_batch_size
        self.global_tokens = t.global_batch_size * cfg.model.seq_length
        self.consumed = 0

    def step(self) -> float:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        loss_sum = torch.zeros(())
        for indices in micro_batch_indices(self.consumed, self.micro_batch, self.num_micro, 0, 1):
            batch = torch.stack([self.dataset[i] for i in indices])
            logits = self.model(batch[:, :-1])
            with loss_parallel() if self.tensor_parallel else nullcontext():
                loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
                (loss / self.global_tokens).backward()
            loss = loss.detach()
            loss_sum += loss.full_tensor() if isinstance(loss, DTensor) else loss
        if self.tensor_parallel:
            clip_grad_norm_(self.model.parameters(), common.CLIP)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), common.CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.consumed += self.global_batch
        return float(loss_sum) / self.global_tokens


def reference_model(cfg) -> ReferenceGPT:
    """The reference model with our model's initial weights (ours built whole, in this process, from the same seed:
    initialization is layout-independent, so these are the weights of every layout)."""
    previous = parallel_state.is_initialized()
    assert not previous, "build the reference before registering the layout"
    parallel_state.initialize_model_parallel(1, 1, ranks=[common.rank()])   # size-1 groups: creates nothing
    ours = GPTModel(cfg.model, TensorParallelRNG(cfg.training.seed, 0, 0, common.CPU))
    ours.initialize(cfg.training.seed)
    reference = ReferenceGPT.like(cfg.model).copy_from(ours)
    parallel_state.destroy_model_parallel()
    return reference


def compare_with_reference(args, tp: int) -> dict:
    """Comparison 1 (tp=1) or 2 (tp=2): our Trainer against the reference model (DTensor TP when tp > 1)."""
    cfg = common.training_config(args, tp=tp, micro_batches=args.micro_batches)
    reference = reference_model(cfg)
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        reference = parallelize(reference, init_device_mesh("cpu", (tp,)))
    peer = ReferenceTrainer(reference, cfg, tensor_parallel=tp > 1)
    parallel_state.initialize_model_parallel(tp, 1)
    trainer = Trainer.on_registered_layout(cfg, common.CPU)
    loss_ours, loss_peer = trainer.train_step()["loss"], peer.step()
    # Single-process steps are short: three times the rounds for the same confidence.
    iters = args.iters * (3 if tp == 1 else 1)
    times = common.alternate({"ours": lambda: trainer.train_step(), "peer": peer.step}, args.warmup, iters,
                             budget_s=budget(args, "single" if tp == 1 else "tp"))
    peer_comm = None
    if tp > 1:   # what DTensor sends (its functional collectives), for comparison
        counter = FunctionalCollectiveCounter()
        with counter.counting(), count_communication() as direct:   # loss_parallel calls torch.distributed
            peer.step()
        peer_comm = {name: (counter.calls[name], counter.elements[name]) for name in counter.calls}
        for (op, _), (calls, elements, _) in direct.totals.items():
            previous = peer_comm.get(op, (0, 0))
            peer_comm[op] = (previous[0] + calls, previous[1] + elements)
    with count_communication() as counter:
        trainer.train_step()
    comm = gather_counts(counter)
    parallel_state.destroy_model_parallel()
    return {"loss_ours": loss_ours, "loss_peer": loss_peer, "ours_ms": times["ours"], "peer_ms": times["peer"],
            "comm": comm, "peer_comm": peer_comm, "params": sum(p.numel() for p in trainer.engine.params)}


# ---------------------------------------------------------------------------------------------------------------------
# Comparisons 3 and 4 (reusing pipeline_bench and dp_bench), and the communication counts of their layouts
# ---------------------------------------------------------------------------------------------------------------------

def compare_pipeline(args, pp: int, v: int) -> dict:
    ns = types.SimpleNamespace(iters=args.iters, warmup=args.warmup + 1, micro_batches=args.pp_micro_batches,
                               micro_batch_size=args.micro_batch, num_layers=args.layers, hidden_size=args.hidden,
                               num_attention_heads=args.heads, seq_length=args.seq, vocab_size=args.vocab,
                               seed=args.seed, budget_s=budget(args, "pp") / 2)
    result = pipeline_bench.bench_layout(ns, pp, v)
    # The communication of a full training step at this layout (our Trainer: schedule + DP + tied embeddings).
    cfg = common.training_config(args, pp=pp, virtual=v if v > 1 else None, micro_batches=args.pp_micro_batches,
                                 dp=common.world_size() // pp)
    parallel_state.initialize_model_parallel(1, pp)
    trainer = Trainer.on_registered_layout(cfg, common.CPU)
    trainer.train_step()
    with count_communication() as counter:
        trainer.train_step()
    result["comm"] = gather_counts(counter)
    parallel_state.destroy_model_parallel()
    return result


def compare_data_parallel(args) -> dict:
    parallel_state.initialize_model_parallel(1, 1)
    ours = {"ours DP": {}, "ours distributed optimizer": dp_bench.DIST_OPT,
            # Our answer to DDP's overlap: smaller buckets reduced as backward fills them (off by default).
            "ours DP, overlapped": dp_bench.OUR_VARIANTS["megalite DP, overlapped reduce"],
            "ours distributed optimizer, overlapped": dp_bench.OUR_VARIANTS["megalite ZeRO-1, overlapped"]}
    engines = dp_bench.build_engines(types.SimpleNamespace(**{**vars(args), "micro_batches": args.dp_micro_batches}),
                                     ours, dp_bench.TORCH_VARIANTS)
    losses = dp_bench.first_losses(engines)
    times = common.alternate({label: e.step for label, e in engines.items()}, args.warmup, args.iters,
                             budget_s=budget(args, "dp"))
    comm = {}
    for label in ("ours DP", "ours distributed optimizer"):
        with count_communication() as counter:
            engines[label].step()
        comm[label] = gather_counts(counter)
    params = sum(p.numel() for p in engines["ours DP"].trainer.engine.params)
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "times": times, "comm": comm, "params": params}


def gather_counts(counter) -> list[dict]:
    """Every rank's counts, on every rank (after the counted step, outside the counter)."""
    mine = counter.as_dict()
    if common.world_size() == 1:
        return [mine]
    out = [None] * common.world_size()
    dist.all_gather_object(out, mine)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one torchrun launch of one world size
# ---------------------------------------------------------------------------------------------------------------------

def worker(args) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    world = dist.get_world_size()
    threads = common.set_threads(world)
    sections = [s for s in args.only.split(",") if WORLD_OF[s] == world]
    log(f"--- {world} rank(s), {threads} thread(s) each, {os.cpu_count()} CPUs, load average "
        f"{common.load_average():.1f}: {', '.join(sections)}")
    results: dict = {"threads": threads}
    for section in sections:
        start = time.perf_counter()
        if section == "single":
            results["single"] = r = compare_with_reference(args, 1)
            log(f"single: first-step loss ours {r['loss_ours']:.7f} plain PyTorch {r['loss_peer']:.7f}")
        elif section == "tp":
            results["tp"] = r = compare_with_reference(args, 2)
            log(f"TP=2: first-step loss ours {r['loss_ours']:.7f} DTensor {r['loss_peer']:.7f}")
        elif section == "pp":
            for pp, v in ((4, 1), (2, 2)):
                results[f"pp{pp}x{v}"] = r = compare_pipeline(args, pp, v)
                log(f"PP={pp} V={v} DP={r['dp']}: first-step loss ours {r['loss_ours']:.7f} torch "
                    f"{r['loss_torch']:.7f}, max rel grad diff {r['grad_diff']:.1e}")
        elif section == "dp":
            results["dp"] = r = compare_data_parallel(args)
            log(f"DP=4: first-step losses {', '.join(f'{k} {v:.7f}' for k, v in r['losses'].items())}")
        log(f"    ({time.perf_counter() - start:.0f} s, load average {common.load_average():.1f})")
    if dist.get_rank() == 0 and args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------------

def summed(comm: list[dict], op: str, kind: str, size: int | None = None, min_size: int = 0) -> int:
    """Elements of ``op`` on ``kind`` groups over all ranks (optionally only calls of ``size`` elements, or of at
    least ``min_size``)."""
    total = 0
    for rank in comm:
        for key, calls in rank["by_size"].items():
            o, k, elements = key.split("|")
            elements = int(elements)
            if o == op and k == kind and (size is None or elements == size) and elements >= min_size:
                total += calls * elements
    return total


def others(comm: list[dict], counted: dict[str, int]) -> str:
    """Everything but the ``counted`` elements ({"op|kind": elements}), summed over ranks, receives left out (the
    same bytes as the sends): '12 all_reduce on data, ...'."""
    rest: dict[str, int] = {}
    for rank in comm:
        for key, (_, elements, _) in rank["totals"].items():
            if not key.startswith("recv|"):
                rest[key] = rest.get(key, 0) + elements
    for key, elements in counted.items():
        rest[key] = rest.get(key, 0) - elements
    return ", ".join(f"{v:,} {k.replace('|', ' on ')}" for k, v in sorted(rest.items()) if v) or "none"


def render(args, results: dict) -> str:
    b, s, h, L = args.micro_batch, args.seq, args.hidden, args.layers
    bsh = b * s * h
    lines = [f"# megalite vs torch-native, {datetime.datetime.now():%Y-%m-%d %H:%M}",
             "",
             f"GPT {L} layers, hidden {h}, {args.heads} heads, seq {s}, vocab {args.vocab}, micro-batch {b}; fp32, "
             f"dropout 0, AdamW, clip 1.0; {os.cpu_count()} CPUs, gloo. Medians over the rounds shown, after "
             f"{args.warmup} warm-up rounds and 1 check step; ratio = median of per-round ours/peer (< 1: ours "
             f"faster), IQR = its 25th-75th percentiles.",
             "",
             "| comparison | peer | rounds | ours ms | peer ms | ours / peer | IQR of ratios | check |",
             "|---|---|---:|---:|---:|---:|---|---|"]

    def row(name, peer, ours_ms, peer_ms, check):
        low, high = common.ratio_spread(ours_ms, peer_ms)
        lines.append(f"| {name} | {peer} | {len(ours_ms)} | {statistics.median(ours_ms):.0f} | "
                     f"{statistics.median(peer_ms):.0f} | **{common.paired_ratio(ours_ms, peer_ms):.3f}** | "
                     f"{low:.3f}-{high:.3f} | {check} |")

    def loss_check(a, b_):
        return f"first loss {a:.6f} vs {b_:.6f} (rel {abs(a - b_) / abs(b_):.0e})"

    if "single" in results:
        r = results["single"]
        row(f"single process, M={args.micro_batches}", "plain PyTorch GPT", r["ours_ms"], r["peer_ms"],
            loss_check(r["loss_ours"], r["loss_peer"]))
    if "tp" in results:
        r = results["tp"]
        row(f"TP=2, M={args.micro_batches}", "DTensor parallelize_module", r["ours_ms"], r["peer_ms"],
            loss_check(r["loss_ours"], r["loss_peer"]))
    for key, label in (("pp4x1", "PP=4, 1F1B"), ("pp2x2", "PP=2 x V=2 (x DP=2), interleaved")):
        if key in results:
            r = results[key]
            row(f"{label}, M={args.pp_micro_batches} (fwd+bwd)", "torch.distributed.pipelining", r["ours_ms"],
                r["torch_ms"], loss_check(r["loss_ours"], r["loss_torch"]) + f", grads rel {r['grad_diff']:.0e}")
    if "dp" in results:
        r = results["dp"]
        t = r["times"]
        losses = r["losses"]
        spread = max(losses.values()) - min(losses.values())
        row(f"DP=4 plain, M={args.dp_micro_batches}/rank", "DDP + AdamW", t["ours DP"], t["torch DDP + AdamW"],
            f"{len(losses)} engines' first losses within {spread:.0e}")
        row("DP=4 distributed optimizer", "DDP + ZeroRedundancyOptimizer", t["ours distributed optimizer"],
            t["torch DDP + ZeroRedundancyOptimizer"], "")
        row("DP=4 plain, overlapped reduce (1M buckets)", "DDP + AdamW", t["ours DP, overlapped"],
            t["torch DDP + AdamW"], "not our default")
        row("DP=4 dist. optimizer, overlapped (1M buckets)", "DDP + ZeroRedundancyOptimizer",
            t["ours distributed optimizer, overlapped"], t["torch DDP + ZeroRedundancyOptimizer"], "not our default")

    # Communication volume
    lines += ["", "Communication per training step of our Trainer, elements summed over ranks (fp32: x4 bytes), "
              "counted at every torch.distributed call:", "",
              "| layout | traffic | counted | analytic minimum | ratio | other traffic (not in the minimum) |",
              "|---|---|---:|---:|---:|---|"]

    def comm_row(layout, what, counted, minimum, rest):
        lines.append(f"| {layout} | {what} | {counted:,} | {minimum:,} | **{counted / minimum:.3f}** | {rest} |")

    if "tp" in results:
        r, m, t = results["tp"], args.micro_batches, 2
        layer_ar = summed(r["comm"], "all_reduce", "tensor", bsh)
        peer = r.get("peer_comm")
        peer_calls = ", ".join(f"{n} {k} ({e:,} elements)" for k, (n, e) in sorted((peer or {}).items()))
        peer_note = f"; DTensor's step, rank 0: {peer_calls}" if peer else ""
        comm_row("TP=2", "all-reduces of b·s·h on TP groups; minimum 4L·M·bsh (layers) + 2·M·bsh (embedding "
                 "forward, output-layer input gradient) per rank", layer_ar,
                 t * (4 * L + 2) * m * bsh, others(r["comm"], {"all_reduce|tensor": layer_ar}) + peer_note)
    for key, label in (("pp4x1", "PP=4"), ("pp2x2", "PP=2 x V=2 x DP=2")):
        if key in results:
            r = results[key]
            pp, v, dp = r["pp"], r["v"], r["dp"]
            sends = summed(r["comm"], "send", "pipeline")
            comm_row(label, "p2p sends (minimum: 2·(PP·V-1)·M·bsh per pipeline)", sends,
                     dp * 2 * (pp * v - 1) * args.pp_micro_batches * bsh, others(r["comm"], {"send|pipeline": sends}))
    if "dp" in results:
        r = results["dp"]
        n, dp = r["params"], 4
        plain = r["comm"]["ours DP"]
        grads = summed(plain, "all_reduce", "data", min_size=1000)   # the buckets, not the scalars
        comm_row("DP=4 plain", "gradient all-reduce (minimum: N params per rank)", grads, dp * n,
                 others(plain, {"all_reduce|data": grads}))
        dist_opt = r["comm"]["ours distributed optimizer"]
        scattered, gathered = summed(dist_opt, "reduce_scatter", "data"), summed(dist_opt, "all_gather", "data")
        comm_row("DP=4 dist. optimizer", "grad reduce-scatter + param all-gather (minimum: 2N per rank)",
                 scattered + gathered, 2 * dp * n,
                 others(dist_opt, {"reduce_scatter|data": scattered, "all_gather|data": gathered}))
    lines += ["", NOTES.format(bsh=bsh)]
    return "\n".join(lines) + "\n"


NOTES = """Notes
- Peers. Single process and TP: the plain PyTorch GPT of bench/reference_gpt.py (same weights, copied from ours);
  TP peer: DTensor ColwiseParallel (QKV, fc1) / RowwiseParallel (proj, fc2), vocab-parallel embedding and tied
  output layer with loss_parallel, no sequence parallelism (as ours here). PP and DP peers wrap our GPTModel (the
  same chunks / model), so that only the engines differ: PP times forward + backward of one global batch (no
  optimizer, no DP or tied-embedding reduction, on both sides); DP times full training steps.
- Ratios are medians of per-round ratios of neighbouring steps; milliseconds are medians and only indicative on a
  shared 2-core machine (4 ranks on 2 cores: 1 thread each; single process: 2 threads).
- Communication. TP minimum: 4 all-reduces of b·s·h ({bsh:,} elements) per layer per micro-batch, forward + backward
  (Shoeybi et al. 2019), plus 2 that any vocabulary-parallel GPT needs: the embedding's forward all-reduce and the
  backward all-reduce of the output layer's input gradient (DTensor's plan has the same two). Other traffic, not in
  the minimum: the vocabulary-parallel cross entropy's per-token max / target logit / sum-of-exp all-reduces (b·s
  each), the gradient-norm all-reduce (1 element). PP minimum: one b·s·h tensor each way per micro-batch per
  virtual-stage boundary; the tied word embedding adds an all-reduce of its V·h gradient between first and last
  stage (needed by weight tying, not by pipelining; torch's pipelining does not do it at all), and the loss and
  bubble statistics a few scalars. DP minimum: one all-reduce of the N gradients (plain), or a reduce-scatter of the
  gradients plus an all-gather of the parameters (distributed optimizer), counted as the full tensor each; buckets
  are padded to a multiple of DP x 16 elements, and the loss / token count / gradient norm add scalars."""


# ---------------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------------

def launch(world: int, argv: list[str], result_file: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               os.path.abspath(__file__), *argv, "--worker", str(world), "--result-file", result_file]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(command, check=True, env=env)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    start = time.perf_counter()
    sections = args.only.split(",")
    results: dict = {}
    argv = [a for a in sys.argv[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted({WORLD_OF[s] for s in sections}):
            path = os.path.join(tmp, f"world{world}.json")
            launch(world, argv, path)
            with open(path) as f:
                results.update(json.load(f))
    table = render(args, results)
    table += f"\nWhole suite: {time.perf_counter() - start:.0f} s.\n"
    print("\n" + table)
    with open(args.output, "w") as f:
        f.write(table)
    print(f"(written to {args.output})")


if __name__ == "__main__":
    main()
