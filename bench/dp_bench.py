"""Data-parallel engines side by side: megalite's (plain and distributed optimizer) against torch's DDP and DDP +
ZeroRedundancyOptimizer, on the same GPT, in one launch.

    torchrun --nproc_per_node 4 bench/dp_bench.py [--iters 10] [--hidden 256] [--layers 4]

Every engine trains the same model (megalite's GPT at TP=PP=1, fp32, dropout off) on the same global batch with
AdamW; one step is forward + backward over the micro-batches + gradient reduction + optimizer step. Times are the
median over --iters steps after two warm-up steps, so absolute numbers mean little on a shared CPU; the ratios
against DDP are the result. Optimizer-state bytes are measured from the tensors each rank holds, next to the
formula (Adam: 8 bytes/param, fp32 main copies 4 more when parameters are not fp32; sharded: / DP).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from megalite import parallel_state
from megalite.config import (DataConfig, LoggingConfig, MegaliteConfig, ModelConfig, OptimizerConfig,
                             ParallelConfig, TrainingConfig)
from megalite.data import MockGPTDataset, micro_batch_indices
from megalite.model import GPTModel
from megalite.tensor_parallel import TensorParallelRNG
from megalite.training import Trainer


def config(args, **optimizer) -> MegaliteConfig:
    return MegaliteConfig(
        model=ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                          seq_length=args.seq, vocab_size=1000, hidden_dropout=0.0, attention_dropout=0.0),
        parallel=ParallelConfig(),
        optimizer=OptimizerConfig(lr=1e-4, **optimizer),
        data=DataConfig(mock_data=True),
        training=TrainingConfig(micro_batch_size=args.micro_batch, global_batch_size=args.global_batch,
                                train_iters=args.iters + 2),
        logging=LoggingConfig(log_interval=10**9),
    )


def time_steps(step, iters: int) -> float:
    times = []
    for i in range(iters + 2):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1000


def megalite_engine(args, **optimizer):
    trainer = Trainer(config(args, **optimizer), torch.device("cpu"))
    ms = time_steps(trainer.train_step, args.iters)
    ddp = trainer.ddp
    grad_bytes = (sum(s.numel() for s in ddp.grad_shards) if ddp.zero2 else ddp.grad_buffer.numel()) * 4
    return ms, trainer.optimizer.state_bytes(), grad_bytes, sum(p.numel() for p in ddp.params)


def torch_engine(args, zero: bool):
    cfg = config(args)
    parallel_state.initialize_model_parallel(1, 1, ranks=[dist.get_rank()])   # model code needs a TP=1 registry
    model = GPTModel(cfg.model, TensorParallelRNG(1, 0, 0, torch.device("cpu")))
    model.initialize(cfg.training.seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=160)   # 40M fp32 elements, as megalite's default bucket
    if zero:
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    dataset = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.training.seed)
    dp, rank = dist.get_world_size(), dist.get_rank()
    num_micro = cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp)
    consumed = [0]

    def step():
        batches = micro_batch_indices(consumed[0], cfg.training.micro_batch_size, num_micro, rank, dp)
        for i, indices in enumerate(batches):
            batch = torch.stack([dataset[j] for j in indices])
            sync = ddp.no_sync() if i < num_micro - 1 else contextlib.nullcontext()
            with sync:
                loss = ddp(batch[:, :-1], batch[:, 1:]).mean() / num_micro
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        consumed[0] += cfg.training.global_batch_size

    ms = time_steps(step, args.iters)
    if zero:
        states = optimizer.optim.state.values()
    else:
        states = optimizer.state.values()
    state_bytes = sum(t.numel() * t.element_size() for s in states for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
    parallel_state.destroy_model_parallel()
    return ms, state_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    dp = dist.get_world_size()

    rows = []
    ddp_ms, ddp_bytes = torch_engine(args, zero=False)
    rows.append(("torch DDP + AdamW", ddp_ms, ddp_bytes, None))
    zero_ms, zero_bytes = torch_engine(args, zero=True)
    rows.append(("torch DDP + ZeroRedundancyOptimizer", zero_ms, zero_bytes, None))
    # Overlap needs several buckets: 1M elements gives a few for the default model (the default 40M gives one).
    small = {"ddp_bucket_size": 1_000_000}
    dist_opt = {"use_distributed_optimizer": True}
    for label, options in [("megalite DP", {}),
                           ("megalite DP, overlapped reduce", {**small, "overlap_grad_reduce": True}),
                           ("megalite distributed optimizer (ZeRO-1)", dist_opt),
                           ("megalite ZeRO-1, overlapped", {**dist_opt, **small, "overlap_grad_reduce": True,
                                                             "overlap_param_gather": True}),
                           ("megalite ZeRO-2", {**dist_opt, "zero_stage": 2}),
                           ("megalite ZeRO-2, overlapped", {**dist_opt, **small, "zero_stage": 2,
                                                             "overlap_grad_reduce": True,
                                                             "overlap_param_gather": True})]:
        parallel_state.initialize_model_parallel(1, 1)
        ms, state_bytes, grad_bytes, params = megalite_engine(args, **options)
        parallel_state.destroy_model_parallel()
        rows.append((label, ms, state_bytes, grad_bytes))

    if dist.get_rank() == 0:
        print(f"\nDP={dp}, GPT {args.layers} layers x hidden {args.hidden}, seq {args.seq}, {params / 1e6:.2f}M params, "
              f"global batch {args.global_batch}, micro-batch {args.micro_batch}, fp32, CPU/gloo, "
              f"median of {args.iters} steps")
        print(f"{'engine':<42} {'ms/step':>9} {'vs DDP':>7} {'Adam state B/param':>19} {'grad B/param':>13}")
        for label, ms, state_bytes, grad_bytes in rows:
            grads = f"{grad_bytes / params:13.2f}" if grad_bytes is not None else f"{'-':>13}"
            print(f"{label:<42} {ms:9.1f} {ms / ddp_ms:7.2f} {state_bytes / params:19.2f} {grads}")
        print(f"formula: Adam states 8 B/param unsharded, 8/DP = {8 / dp:.2f} sharded; fp32 grads 4 B/param, "
              f"4/DP = {4 / dp:.2f} with ZeRO-2 (plus padding to DP x 16 elements per bucket)")
        print("ZeRO-2 reduce-scatters every micro-batch (to free gradients), so it moves M times the data of ZeRO-1.")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
