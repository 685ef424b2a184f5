"""Data-parallel engines side by side: megalite's (plain and distributed optimizer) against torch's DDP and DDP +
ZeroRedundancyOptimizer, on the same GPT, in one launch.

    torchrun --nproc_per_node 4 bench/dp_bench.py [--iters 8] [--hidden 256] [--layers 4]

Every engine trains the same model (megalite's GPT at TP=PP=1, fp32, dropout off, same initial weights) on the same
global batch with the same AdamW (constant learning rate, no weight decay on biases and norms) and gradient clipping
at norm 1; one step is forward + backward over the micro-batches + gradient reduction + clipping + optimizer step.
The torch engines wrap the same GPTModel (not the plain reference model) so that only the data-parallel engine
differs; bench/run_all.py compares the model itself with plain PyTorch separately. Engines take turns step by step
(see bench/common.py) and the ratios against DDP are medians of per-round ratios, so absolute numbers mean little on
a shared CPU. Optimizer-state bytes are measured from the tensors each rank holds, next to the formula (Adam: 8
bytes/param, fp32 main copies 4 more when parameters are not fp32; sharded: / DP).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import common
from megalite import parallel_state
from megalite.data import MockGPTDataset, micro_batch_indices
from megalite.model import GPTModel
from megalite.tensor_parallel import TensorParallelRNG
from megalite.training import Trainer


class TorchEngine:
    """torch's DistributedDataParallel around our GPTModel, with torch.optim.AdamW or ZeroRedundancyOptimizer(AdamW);
    gradient accumulation under ``no_sync`` as DDP's documentation has it. Needs a TP=1 layout registered (the model
    code asks for its TP size)."""

    def __init__(self, cfg, zero: bool, **ddp_options):
        model = GPTModel(cfg.model, TensorParallelRNG(cfg.training.seed, 0, 0, common.CPU))
        model.initialize(cfg.training.seed)
        self.model = model
        self.ddp = DistributedDataParallel(model, **ddp_options)
        if zero:
            self.optimizer = ZeroRedundancyOptimizer(common.param_groups(self.ddp.parameters()),
                                                     optimizer_class=torch.optim.AdamW, lr=common.LR,
                                                     betas=(0.9, 0.999), eps=1e-8)
        else:
            self.optimizer = common.adamw(self.ddp.parameters())
        self.zero = zero
        self.dataset = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.training.seed)
        self.dp, self.rank = dist.get_world_size(), dist.get_rank()
        t = cfg.training
        self.micro_batch, self.global_batch = t.micro_batch_size, t.global_batch_size
        self.num_micro = t.global_batch_size // (t.micro_batch_size * self.dp)
        self.global_tokens = t.global_batch_size * cfg.model.seq_length
        self.consumed = 0

    def step(self) -> float:
        """One training step; the global-batch mean loss."""
        batches = micro_batch_indices(self.consumed, self.micro_batch, self.num_micro, self.rank, self.dp)
        loss_sum = torch.zeros(())
        for i, indices in enumerate(batches):
            batch = torch.stack([self.dataset[j] for j in indices])
            sync = self.ddp.no_sync() if i < self.num_micro - 1 else contextlib.nullcontext()
            with sync:
                loss = self.ddp(batch[:, :-1], batch[:, 1:]).sum()
                (loss / self.global_tokens).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), common.CLIP)   # gradients are whole after DDP
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.consumed += self.global_batch
        dist.all_reduce(loss_sum)
        return float(loss_sum) / self.global_tokens

    def state_bytes(self) -> int:
        states = (self.optimizer.optim if self.zero else self.optimizer).state.values()
        return sum(t.numel() * t.element_size() for s in states for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0)


class OurEngine:
    """megalite's Trainer (its DataParallel engine and optimizer) with the given optimizer options."""

    def __init__(self, cfg):
        self.trainer = Trainer.on_registered_layout(cfg, common.CPU)

    def step(self) -> float:
        return self.trainer.train_step()["loss"]

    def state_bytes(self) -> int:
        return self.trainer.optimizer.state_bytes()

    def grad_bytes(self) -> int:
        return self.trainer.engine.held_bytes()[1]


# Overlap needs several buckets: 1M elements gives a few for the default model (the default 40M gives one).
SMALL_BUCKETS = {"ddp_bucket_size": 1_000_000}
DIST_OPT = {"use_distributed_optimizer": True}
OUR_VARIANTS = {
    "megalite DP": {},
    "megalite DP, overlapped reduce": {**SMALL_BUCKETS, "overlap_grad_reduce": True},
    "megalite distributed optimizer (ZeRO-1)": DIST_OPT,
    "megalite ZeRO-1, overlapped": {**DIST_OPT, **SMALL_BUCKETS, "overlap_grad_reduce": True,
                                    "overlap_param_gather": True},
    "megalite ZeRO-2": {**DIST_OPT, "zero_stage": 2},
    "megalite ZeRO-2, overlapped": {**DIST_OPT, **SMALL_BUCKETS, "zero_stage": 2, "overlap_grad_reduce": True,
                                    "overlap_param_gather": True},
}
TORCH_VARIANTS = {"torch DDP + AdamW": False, "torch DDP + ZeroRedundancyOptimizer": True}


def build_engines(args, ours: dict[str, dict], theirs: dict[str, bool]) -> dict:
    """Engines by label; the caller has registered a TP=1, PP=1 layout over the world (DP = world size)."""
    dp = dist.get_world_size()
    engines = {}
    for label, zero in theirs.items():
        engines[label] = TorchEngine(common.training_config(args, micro_batches=args.micro_batches, dp=dp), zero)
    for label, options in ours.items():
        engines[label] = OurEngine(common.training_config(args, micro_batches=args.micro_batches, dp=dp,
                                                          **options))
    return engines


def first_losses(engines: dict) -> dict[str, float]:
    """One step of each engine from the same weights and data: their losses must agree."""
    return {label: engine.step() for label, engine in engines.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per DP rank per step")
    common.add_model_arguments(parser)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    common.set_threads(dist.get_world_size())
    dp = dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1)
    engines = build_engines(args, OUR_VARIANTS, TORCH_VARIANTS)
    losses = first_losses(engines)
    times = common.alternate({label: e.step for label, e in engines.items()}, args.warmup - 1, args.iters)
    params = sum(p.numel() for p in engines["torch DDP + AdamW"].model.parameters())

    if dist.get_rank() == 0:
        print(f"\nDP={dp}, GPT {args.layers} layers x hidden {args.hidden}, seq {args.seq}, "
              f"{params / 1e6:.2f}M params, micro-batch {args.micro_batch} x {args.micro_batches} per rank, fp32, "
              f"CPU/gloo; median of {args.iters} rounds; first-step losses "
              f"{sorted(set(f'{v:.6f}' for v in losses.values()))}")
        print(f"{'engine':<42} {'ms/step':>9} {'vs DDP*':>8} {'Adam state B/param':>19} {'grad B/param':>13}")
        ddp = times["torch DDP + AdamW"]
        for label, engine in engines.items():
            grads = f"{engine.grad_bytes() / params:13.2f}" if isinstance(engine, OurEngine) else f"{'-':>13}"
            print(f"{label:<42} {statistics.median(times[label]):9.1f} {common.paired_ratio(times[label], ddp):8.2f} "
                  f"{engine.state_bytes() / params:19.2f} {grads}")
        print("* median of per-round ratios")
        print(f"formula: Adam states 8 B/param unsharded, 8/DP = {8 / dp:.2f} sharded; fp32 grads 4 B/param, "
              f"4/DP = {4 / dp:.2f} with ZeRO-2 (plus padding to DP x 16 elements per bucket)")
        print("ZeRO-2 reduce-scatters every micro-batch (to free gradients), so it moves M times the data of ZeRO-1.")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
