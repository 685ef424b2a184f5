"""What checkpoint digests cost, and how long a save stalls training, synchronous against --async-save.

    python bench/checkpoint_bench.py [--megabytes 256] [--rounds 7] [--hidden-size 384] [--num-layers 6] [--threads N]

1. Digests. The same tensors (``--megabytes`` of fp32) saved through DCP's own ``FileSystemWriter`` and through ours
   (which hashes every item after writing it, megalite.checkpoint.digests), and read back with and without checking
   them first; the two sides take turns, round by round, and the ratio is the median of the per-round ratios. The
   goal is a digest cost under 5% of a save.
2. Stall. One process trains a GPT; in each round a few steps without a save (the baseline), a synchronous save
   followed by the same steps, and an asynchronous one followed by them until it is in place; the stall is each
   one's time over the baseline, and the ratio async / sync is the median over rounds.

Single process, CPU: absolute times depend on the disk and on whatever else the machine runs; the ratios are the
figures to read. On a small shared machine ``--threads 1`` keeps torch's thread pool from spinning against the other
load (and leaves the writing thread a core, as a GPU machine's otherwise idle CPUs would).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from megalite import parallel_state  # noqa: E402
from megalite.checkpoint.contents import Checkpoint  # noqa: E402
from megalite.checkpoint.digests import default_algorithm  # noqa: E402
from megalite.checkpoint.manifest import Digests, Manifest, SavedLayout  # noqa: E402
from megalite.checkpoint.storage import read_metadata, write_tensors  # noqa: E402
from megalite.config import (CheckpointConfig, DataConfig, LoggingConfig, MegaliteConfig, ModelConfig,  # noqa: E402
                             OptimizerConfig, TrainingConfig)
from megalite.training import Trainer  # noqa: E402

CPU = torch.device("cpu")


def _median_ratio(ours: list[float], peer: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(ours, peer))


def _seconds(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def digest_cost(megabytes: int, rounds: int, scratch: Path) -> None:
    count = max(1, megabytes // 4)
    tensors = {f"model/t{i}/tp1_0": torch.randn(1 << 20) for i in range(count)}   # 4 MiB each
    keys, size = list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())
    times: dict[str, list[float]] = {name: [] for name in ("plain", "ours", "hash", "read", "check")}
    for r in range(rounds):
        plain, ours = scratch / f"plain{r}", scratch / f"ours{r}"

        def dcp_save():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(plain)), no_dist=True)

        written = []
        saves = [("plain", dcp_save), ("ours", lambda: written.append(write_tensors(ours, tensors, False)))]
        for name, save in (saves if r % 2 else saves[::-1]):
            times[name].append(_seconds(save))
        write = written[0]
        manifest = Manifest(iteration=0, consumed_samples=0, layout=SavedLayout(), config={}, params={},
                            digests=Digests(write.algorithm, write.index_digest, write.digests))
        checkpoint = Checkpoint(ours, manifest, read_metadata(ours))

        def check():
            Checkpoint(ours, manifest, checkpoint.metadata).verify_contents(keys)

        times["hash"].append(_seconds(check))   # the hashing our writer adds to a save, as a load repeats it

        def read():
            fresh = Checkpoint(ours, manifest, checkpoint.metadata)
            fresh.mark_verified(keys)
            fresh.read(keys)

        loads = [("read", read), ("check", check)]
        for name, load in (loads if r % 2 else loads[::-1]):
            times[name].append(_seconds(load))
        shutil.rmtree(plain)
        shutil.rmtree(ours)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    print(f"digests ({default_algorithm()}), {size / 2**20:.0f} MiB in {count} tensors, {rounds} rounds "
          f"(medians; ratios: median of per-round ratios):")
    print(f"  save: DCP's writer {ms['plain']:.0f} ms, ours {ms['ours']:.0f} ms (ratio "
          f"{_median_ratio(times['ours'], times['plain']):.3f}); hashing what was written {ms['hash']:.1f} ms = "
          f"{100 * _median_ratio(times['hash'], times['plain']):.1f}% of DCP's save")
    print(f"  load: reading every tensor {ms['read']:.0f} ms; checking them first {ms['check']:.1f} ms = "
          f"{100 * _median_ratio(times['check'], times['read']):.1f}% of the read")


def _config(args, save: str, asynchronous: bool) -> MegaliteConfig:
    return MegaliteConfig(
        model=ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=4,
                          seq_length=128, vocab_size=1001, hidden_dropout=0.0, attention_dropout=0.0),
        optimizer=OptimizerConfig(lr=1e-4), data=DataConfig(mock_data=True, eval_interval=0),
        training=TrainingConfig(micro_batch_size=4, global_batch_size=8, train_iters=10**6),
        logging=LoggingConfig(log_interval=10**6), checkpoint=CheckpointConfig(save=save, async_save=asynchronous))


def save_stall(args, scratch: Path) -> None:
    parallel_state.initialize_model_parallel(1, 1)
    sync = Trainer.on_registered_layout(_config(args, str(scratch / "sync"), False), CPU)
    asynchronous = Trainer.on_registered_layout(_config(args, str(scratch / "async"), True), CPU)
    sync.logger.print = asynchronous.logger.print = lambda *_: None
    params = sum(p.numel() for _, p in sync.canonical_named_parameters())
    for trainer in (sync, asynchronous):
        for _ in range(2):
            trainer.train_step()

    def steps(trainer):
        for _ in range(args.steps_after):
            trainer.train_step()

    # Blocked: the time the training loop spends inside save calls (the save itself; for async, starting it, the
    # per-iteration check and the commit, and waiting at the end if it is not written by then). Wall: the whole
    # window (save + steps) over the same steps without a save, which adds what the writing thread takes from the
    # training steps (on 2 shared cores, a lot: on a GPU machine the steps run on the GPU).
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    wall: dict[str, list[float]] = {"sync": [], "async": []}
    base = []
    for r in range(args.rounds):
        base.append(_seconds(lambda: steps(asynchronous)))
        pair = [("sync", sync), ("async", asynchronous)]
        for name, trainer in (pair if r % 2 else pair[::-1]):
            start = time.perf_counter()
            inside = _seconds(lambda: trainer.save_checkpoint(trainer.cfg.checkpoint.save))
            for _ in range(args.steps_after):
                trainer.train_step()
                inside += _seconds(lambda: trainer.finish_save(wait=False))
            inside += _seconds(trainer.finish_save)   # an async save not written by now is waited for
            blocked[name].append(inside)
            wall[name].append(time.perf_counter() - start - base[-1])
            for old in sorted(Path(trainer.cfg.checkpoint.save).glob("iter_*"))[:-1]:
                shutil.rmtree(old)
    step_ms = statistics.median(base) / args.steps_after * 1e3
    print(f"save stall: GPT {args.num_layers} x {args.hidden_size} ({params / 1e6:.1f}M parameters, checkpoint "
          f"{params * 12 / 2**20:.0f} MiB with Adam), a step {step_ms:.0f} ms, {args.steps_after} steps after each "
          f"save, {args.rounds} rounds (medians):")
    median_ms = {kind: {name: statistics.median(v) * 1e3 for name, v in values.items()}
                 for kind, values in (("blocked", blocked), ("wall", wall))}
    print(f"  training blocked in save calls: sync {median_ms['blocked']['sync']:.0f} ms, async "
          f"{median_ms['blocked']['async']:.0f} ms: async / sync "
          f"{_median_ratio(blocked['async'], blocked['sync']):.3f}")
    print(f"  wall time over the same steps without a save: sync {median_ms['wall']['sync']:.0f} ms, async "
          f"{median_ms['wall']['async']:.0f} ms")
    parallel_state.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256, help="size of the tensors of the digest comparison")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hidden-size", type=int, default=384)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--steps-after", type=int, default=6, help="training steps after each save")
    parser.add_argument("--only", choices=["digests", "stall"], help="run one of the two parts")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), {os.cpu_count()} CPUs")
    scratch = Path(tempfile.mkdtemp(prefix="megalite-ckpt-bench-"))
    try:
        if args.only != "stall":
            digest_cost(args.megabytes, args.rounds, scratch)
        if args.only != "digests":
            save_stall(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
