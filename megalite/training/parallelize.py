"""A run's parallelism applied to this rank, in one place: its pipeline (stages, schedule, links), its model chunks
built, initialized and cast, and the data-parallel engine that sums their gradients (and shards them and the
optimizer). The trainer is handed what this returns and only runs steps."""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from megalite import parallel_state
from megalite.distributed import DataParallel, DataParallelEngine, EngineUnion, FullyShardedDataParallel, is_expert
from megalite.kernels import KernelPolicy, prepare
from megalite.model import GPTModel
from megalite.pipeline import Pipeline
from megalite.run import Run
from megalite.tensor_parallel import TensorParallelRNG, attach_weight_grad_store
from megalite.training.compilation import compile_layers


class Parallelized(NamedTuple):
    model: torch.nn.ModuleList     # this rank's chunks, one per virtual stage
    engine: DataParallelEngine
    pipeline: Pipeline
    rng: TensorParallelRNG
    dtype: torch.dtype             # the compute dtype


def parallelize(run: Run, device: torch.device) -> Parallelized:
    """This rank's part of ``run`` on ``device`` (the registered layout's groups); collective (kernel checks)."""
    cfg, m, o, t = run.cfg, run.cfg.model, run.cfg.optimizer, run.cfg.training
    dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
    pipeline = Pipeline(cfg, run.dims, dtype, device)
    rng = TensorParallelRNG(t.seed, parallel_state.get_tensor_model_parallel_rank(), pipeline.rank, device,
                            parallel_state.get_context_parallel_rank())
    # Fused CUDA kernels or torch ops, per op: built, self-checked and agreed over every rank now, before any step.
    kernels = prepare(KernelPolicy.from_config(cfg.kernels), device, 60 * t.distributed_timeout_minutes)
    # Simulated GPUs (megalite.simulation) build the chunks on their meta device directly: no host memory.
    with torch.device(device) if device.type == "meta" else contextlib.nullcontext():
        model = torch.nn.ModuleList(
            GPTModel(m, rng, pre_process=c.is_first, post_process=c.is_last, layer_offset=c.first_layer,
                     num_layers=c.num_layers, sequence_parallel=cfg.parallel.sequence_parallel, kernels=kernels)
            for c in pipeline.chunks).to(device)
    for chunk in model:
        chunk.initialize(t.seed)   # in fp32, then cast: the same initial weights for every dtype and layout
    if cfg.kernels.torch_compile:   # torchtitan's order: TP (built into the layers), recompute, compile, FSDP
        compile_layers(model, cfg.kernels.torch_compile_backend, m.seq_length, device)
    # Context-parallel ranks hold the same weights: gradients are summed over DP x CP, and the distributed
    # optimizer and ZeRO-3 shard over it, or with HSDP over one instance of it, replicated across the instances. With
    # the first and last stage on one rank (v-shape) both embedding copies are here: summed locally.
    shared = dict(data_group=parallel_state.get_intra_distributed_optimizer_instance_group(),
                  replica_group=parallel_state.get_inter_distributed_optimizer_instance_group(),
                  tensor_group=parallel_state.get_tensor_model_parallel_group(),
                  embedding_group=parallel_state.get_embedding_group() if pipeline.loss_rank != 0 else None,
                  tied_params=[w for chunk in model for w in chunk.tied_embedding_weights()])
    # Routed experts' gradients are summed over the ranks holding the same experts (megalite.distributed.
    # expert_parallel): their own engine, or their own FSDP2 units.
    expert_data = (parallel_state.get_expert_data_parallel_group()
                   if any(is_expert(p) for p in model.parameters()) else None)
    grad_dtype = torch.bfloat16 if o.grad_reduce_in_bf16 else torch.float32
    engine: DataParallelEngine
    if o.zero_level == 3:   # FSDP2 keeps fp32 shards as main parameters and casts the gathered copies itself
        engine = FullyShardedDataParallel(list(model), **shared, compute_dtype=dtype, offload_params=o.offload_params,
                                          prefetch_bucket_size=o.zero3_prefetch_bucket_size, grad_dtype=grad_dtype,
                                          expert_group=expert_data, fp8_param_gather=m.fp8_param_gather)
    else:
        model.to(dtype)
        dense = functools.partial(DataParallel, list(model), bucket_size=o.ddp_bucket_size, zero=o.zero_level,
                                  grad_dtype=grad_dtype, overlap_grad_reduce=o.overlap_grad_reduce,
                                  overlap_param_gather=o.overlap_param_gather,
                                  # A compiled layer's backward cannot write into the engine's buckets (a
                                  # side effect dynamo does not trace): its weights get gradients, summed by hooks.
                                  gradient_accumulation_fusion=not (o.no_gradient_accumulation_fusion
                                                                    or cfg.kernels.torch_compile),
                                  fp8_param_gather=m.fp8_param_gather)
        engine = dense(**shared) if expert_data is None else EngineUnion([
            dense(**shared, select=lambda p: not is_expert(p)),
            dense(data_group=expert_data, tensor_group=shared["tensor_group"], select=is_expert)])   # no HSDP
    attach_weight_grad_store(model, pipeline.weight_grads)   # zero-bubble schedules defer weight gradients
    return Parallelized(model, engine, pipeline, rng, dtype)
