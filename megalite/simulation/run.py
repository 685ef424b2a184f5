"""One rank of an N-GPU job, simulated in this process: the real code path on meta tensors, under NCCL's rules.

What runs is megalite's own: the groups of the layout (on torch's fake process group, megalite.simulation.world),
the trainer with its model chunks, data-parallel engine, pipeline schedule and optimizer, two training iterations.
What is different from a GPU run, and why:

- Device memory is the ``meta`` device: tensors with shapes and dtypes and no values, so a 70B model's rank costs no
  host memory and no arithmetic. torch's fake CUDA tensors (``FakeTensorMode``) were the other candidate; autograd on
  them aborts the process on a CPU build of torch, while meta tensors run forward and backward and refuse to mix with
  CPU tensors as CUDA ones do.
- Values read on the host are stand-ins (megalite.simulation.host_reads), counted by call site; the mixture of
  experts routes every expert the same number of tokens (the balanced load the router aims for).
- The attention core goes to the kernels CUDA would pick (flash without a mask, memory-efficient with one):
  ``scaled_dot_product_attention`` on meta tensors would otherwise take the math path and keep s x s scores.
- Kernels of megalite's own (csrc/) run as the torch ops they replace; evaluation, checkpoints and logging are off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant
from torch.utils._python_dispatch import _disable_current_modes

from megalite import parallel_state
from megalite.config import MegaliteConfig
from megalite.run import Run
from megalite.simulation.communication import CommCounter, count_communication
from megalite.simulation.host_reads import answering_host_reads
from megalite.simulation.memory import MemoryTracker
from megalite.simulation.world import simulated_world

DEVICE = torch.device("meta")


@dataclass
class RankReport:
    rank: int
    coordinates: dict            # tp, cp, dp, pp ranks
    peak_bytes: int
    peak_by_category: dict       # weights, gradients, optimizer, activations (and buffers, temporaries)
    peak_phase: str
    communication: dict          # (op, group kind) -> [calls, elements, bytes] of the second iteration
    host_reads: dict             # call site -> reads in the second iteration


def simulation_config(cfg: MegaliteConfig) -> MegaliteConfig:
    """What the simulated run changes: two iterations, nothing written or read beside the data, no evaluation."""
    return dataclasses.replace(
        cfg,
        training=dataclasses.replace(cfg.training, train_iters=2, train_samples=None, exit_interval=None,
                                     exit_duration_in_mins=None, exit_signal_handler=False, simulate_gpus=0),
        data=dataclasses.replace(cfg.data, eval_interval=0, no_data_prefetch=True),
        logging=dataclasses.replace(cfg.logging, quiet=True, metrics_file=None, tensorboard_dir=None, profile=False,
                                    timing_log_level=0, wandb_project=None),
        checkpoint=dataclasses.replace(cfg.checkpoint, save=None, load=None))


def _attention_as_cuda_picks(original):
    """``scaled_dot_product_attention`` on meta tensors through the kernel CUDA would choose, for its memory."""
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not query.is_meta:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        if attn_mask is None or isinstance(attn_mask, CausalBias):   # a causal bias runs as flash does (its memory)
            return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p,
                                                                     is_causal or attn_mask is not None, False,
                                                                     scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, True, dropout_p,
                                                                      is_causal, scale=scale)[0]
    return sdpa


def _balanced_routing(top_k: int):
    """(dispatch, split sizes): stand-ins for megalite.model's token dispatch and its one host read, routing every
    expert the same number of (token, expert) pairs, T k / E of a rank's T tokens (the load the router balances
    towards; counts are values, which meta tensors do not hold)."""
    from megalite.model import dispatcher, moe   # noqa: PLC0415 - what is stood in for
    layer = {}   # the layer being dispatched: its tokens and experts

    def dispatch(kind, tokens, routing, routing_map, experts):
        layer.update(tokens=routing_map.shape[0], experts=routing_map.shape[1],
                     ep=parallel_state.get_expert_model_parallel_world_size())
        return dispatcher.dispatch_and_combine(kind, tokens, routing, routing_map, experts)

    def split_sizes(counts: torch.Tensor) -> list[int]:
        counts.tolist()   # counted where the dispatcher asks, as every host read is (megalite.simulation.host_reads)
        pairs, experts, ep = layer["tokens"] * top_k, layer["experts"], layer["ep"]
        if ep > 1 and counts.numel() == experts // ep:   # allgather: the local experts' share of every rank's tokens
            experts //= ep
        share, left = divmod(pairs, experts)
        block = [share + (e < left) for e in range(experts)]
        return (block * (counts.numel() // experts + 1))[:counts.numel()]

    return [(moe, "dispatch_and_combine", dispatch), (dispatcher, "split_sizes_to_host", split_sizes)]


class _MetaStream(torch.cpu.Stream):
    """The CPU's stream, which does nothing, but records an event as a CUDA stream does (FSDP2's HSDP keeps the
    all-reduce's event to wait on it)."""

    def record_event(self, event=None):
        return torch.cpu.Event()


class _MetaDeviceModule(types.ModuleType):
    """``torch.meta``, the device module FSDP2 looks up by the mesh's device type (``torch.cuda`` on GPUs): the CPU's
    streams and events (which do nothing), and no device index."""
    Stream = _MetaStream

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device():
        return None

    @staticmethod
    def current_stream(device=None):
        return _MetaStream()


@contextlib.contextmanager
def _as_on_gpus(cfg: MegaliteConfig) -> Iterator[None]:
    """What a GPU run has that meta tensors lack: the attention kernels CUDA picks, values for the mixture of
    experts' split sizes, and FSDP2 (ZeRO-3) accepting a meta device mesh and parameters that stay on meta (it
    insists they be materialized first)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup  # noqa: PLC0415 - torch's own

    from megalite.model import context_parallel   # noqa: PLC0415 - what is stood in for

    def causal_lower_right(*size):   # a tensor subclass torch cannot build under a dispatch mode (the tracker's)
        with _disable_current_modes():
            return CausalBias(CausalVariant.LOWER_RIGHT, *size)

    patches = [(F, "scaled_dot_product_attention", _attention_as_cuda_picks(F.scaled_dot_product_attention)),
               (context_parallel, "causal_lower_right", causal_lower_right),
               (torch, "meta", _MetaDeviceModule("torch.meta")),
               (FSDPParamGroup, "_validate_no_meta_params", lambda self: None),
               *_balanced_routing(cfg.model.moe_router_topk)]
    originals = [(owner, name, getattr(owner, name, None)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in originals:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _subtract(after: CommCounter, before: dict) -> dict:
    out = {}
    for key, (calls, elements, nbytes) in after.totals.items():
        c0, e0, b0 = before.get(key, (0, 0, 0))
        if calls - c0:
            out[key] = [calls - c0, elements - e0, nbytes - b0]
    return out


def _named_tensors(trainer) -> dict[str, list[torch.Tensor]]:
    """The run's weights, gradients and optimizer states, for the memory categories."""
    params = list(trainer.model.parameters())
    grads = [piece.grad for piece in trainer.engine.pieces()]
    grads += [t for p in params for t in (p.grad, getattr(p, "main_grad", None)) if t is not None]
    optimizer = trainer.optimizer
    held = list(optimizer.inner.state.values()) + (list(optimizer.muon.state.values()) if optimizer.muon else [])
    states = [t for state in held for t in state.values() if torch.is_tensor(t)]
    return {"weights": params, "gradients": grads,
            "optimizer": [piece.main for piece in trainer.optimizer.pieces] + states}


def simulate_rank(run: Run, rank: int) -> RankReport:
    """Run rank ``rank`` of the run's simulated GPUs for two iterations; what it held and sent."""
    from megalite.training import Trainer   # noqa: PLC0415 - the trainer is what is simulated

    cfg, world_size = simulation_config(run.cfg), run.dims.world
    run = dataclasses.replace(run, cfg=cfg)
    p = cfg.parallel
    tracker = MemoryTracker()
    with simulated_world(world_size, rank), answering_host_reads() as reads, \
            count_communication(nccl_device=DEVICE) as counter, _as_on_gpus(cfg):
        parallel_state.initialize_model_parallel(
            p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
            context_parallel_size=p.context_parallel_size, expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
            num_distributed_optimizer_instances=p.num_distributed_optimizer_instances)
        try:
            coordinates = {"tp": parallel_state.get_tensor_model_parallel_rank(),
                           "cp": parallel_state.get_context_parallel_rank(),
                           "dp": parallel_state.get_data_parallel_rank(),
                           "pp": parallel_state.get_pipeline_model_parallel_rank()}
            with tracker:
                tracker.label = "building the model"
                trainer = Trainer(run, DEVICE)
                trainer.describe()
                tracker.label = "iteration 1"
                trainer.train_step()
                first = {k: list(v) for k, v in counter.totals.items()}
                reads.clear()
                tracker.label = "iteration 2"
                trainer.train_step()
                communication = _subtract(counter, first)
                host_reads = dict(reads)
            named = _named_tensors(trainer)
            by_category = tracker.categorize(named)
            trainer.prefetcher.close()
        finally:
            parallel_state.destroy_model_parallel()
    return RankReport(rank, coordinates, tracker.peak, by_category, tracker.peak_label, communication, host_reads)
