"""Saving: each rank writes only its own pieces, through one collective DCP save, into a directory made visible
atomically (see :mod:`megalite.checkpoint.directory`).

Who writes what, so that every piece is stored exactly once:

- model weights: data-parallel rank 0 (DP replicas are equal; ZeRO-3 shards are gathered), each TP rank its slice (TP rank 0 alone for
  replicated tensors); the last stage's copy of a tied word embedding is the first stage's tensor, and is skipped;
  a routed expert's weights (expert parallelism) come from expert-data-parallel rank 0 of the ranks holding it,
  under its global name, so the experts reshard across EP by name;
- optimizer state (fp32 main parameter, Adam moments) per piece of :class:`MegaliteOptimizer`: with the
  distributed optimizer every DP rank writes the ranges it owns (with HSDP those of the first instance), without
  it DP rank 0 writes whole parameters;
- RNG states: every rank, under its (pp, tp, dp) coordinates;
- FP8 amax histories (delayed scaling), equal on every rank holding the layer: TP and DP rank 0 of its stage;
- the manifest, with every rank's digests, and the tokenizer's files (which tools/generate.py uses): rank 0, last.

:func:`start_save` returns a :class:`PendingSave`: with ``asynchronous`` (``--async-save``) the tensors are copied
and written in the background while training goes on; :meth:`PendingSave.ready` says (collectively) when every rank's
write has completed, and only then does :meth:`PendingSave.finish` write the manifest, rename the checkpoint into
place and point to it. A process killed before that leaves the previous checkpoint in charge. A save whose weights or
optimizer states are not finite is refused before anything is written (:class:`NotFiniteError`, on every rank).

"DP" here is DP x CP: context-parallel ranks hold the same weights, and the optimizer shards over all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megalite import parallel_state
from megalite.checkpoint import directory as ckpt_dir
from megalite.checkpoint.errors import CheckpointError, NotFiniteError, SaveError
from megalite.checkpoint.keys import fp8_key, model_key, optimizer_key, rng_key, slice_of, stores_slice
from megalite.checkpoint.digests import digest_bytes
from megalite.checkpoint.manifest import MANIFEST_NAME, Digests, Manifest, SavedLayout, TensorSpec
from megalite.checkpoint.model_specs import model_parameters
from megalite.checkpoint.storage import METADATA_NAME, TensorWrite, world_size, write_tensors
from megalite.config import MegaliteConfig, to_dict
from megalite.data.tokenizer import Tokenizer
from megalite.distributed import full_local_tensor, is_expert
from megalite.optimizer import MegaliteOptimizer
from megalite.tensor_parallel import Fp8History, TensorParallelRNG


@dataclasses.dataclass
class _Coordinates:
    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    dp: int
    dp_rank: int
    expert_dp_rank: int   # among the ranks holding the same experts (expert parallelism)
    instance: int   # HSDP: which distributed-optimizer instance (its shards are the other instances' too)

    @classmethod
    def registered(cls) -> "_Coordinates":
        """This rank's place; its ``dp`` is DP x CP (the ranks holding its model shard, over which the optimizer
        is sharded)."""
        ps = parallel_state
        return cls(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                   ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
                   ps.get_data_parallel_world_size(with_context_parallel=True),
                   ps.get_data_parallel_rank(with_context_parallel=True),
                   ps.get_expert_data_parallel_group().rank,
                   ps.get_inter_distributed_optimizer_instance_group().rank)

    def replica(self, param: torch.nn.Parameter) -> int:
        """This rank's place among the ranks holding the same copy of ``param``: the writer is the one at 0."""
        return self.expert_dp_rank if is_expert(param) else self.dp_rank


def save_checkpoint(root: str | Path, *, cfg: MegaliteConfig, iteration: int, consumed_samples: int,
                    parameters: list[tuple[str, torch.nn.Parameter]], optimizer: Optional[MegaliteOptimizer] = None,
                    rng: Optional[TensorParallelRNG] = None, tokenizer: Optional[Tokenizer] = None,
                    device: torch.device = torch.device("cpu")) -> Path:
    """Save this rank's part of the model (``parameters``: canonical name, parameter of this rank's chunks) and
    optimizer into ``root/iter_NNNNNNN``; collective over every rank of the registered layout, which must be the
    whole world or a single process. Returns the checkpoint directory once it is complete and the pointer is set."""
    return start_save(root, cfg=cfg, iteration=iteration, consumed_samples=consumed_samples, parameters=parameters,
                      optimizer=optimizer, rng=rng, tokenizer=tokenizer, device=device).finish()


class PendingSave:
    """A save whose tensors are being written (see the module docstring); every rank holds one."""

    def __init__(self, write: TensorWrite, manifest: Manifest, tokenizer: Optional[Tokenizer], temporary: Path,
                 final: Path, collective: bool, device: torch.device):
        self.iteration = manifest.iteration
        self._write, self._manifest, self._tokenizer = write, manifest, tokenizer
        self._temporary, self._final, self._collective, self._device = temporary, final, collective, device

    def ready(self) -> bool:
        """Whether every rank's write has completed: a collective (all ranks call it at the same point) when the
        save is; the same answer on every rank."""
        if not self._collective:
            return self._write.done()
        pending = torch.tensor([0.0 if self._write.done() else 1.0], device=self._device)
        dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        return not bool(pending.item())

    def finish(self) -> Path:
        """Wait for every rank's write, then (rank 0) write the manifest with every rank's digests, rename the
        checkpoint into place and point to it; collective. Returns the checkpoint directory."""
        self._write.wait()   # a failed write on any rank raises here on every rank

        def commit() -> None:
            files = _save_tokenizer(self._tokenizer, self._temporary)
            digests = Digests(self._write.algorithm, self._write.index_digest, self._write.digests,
                              {name: digest_bytes(data, self._write.algorithm) for name, data in files.items()})
            manifest = dataclasses.replace(self._manifest, tokenizer=_tokenizer_entry(self._tokenizer, files),
                                           digests=digests)
            ckpt_dir.write_file(self._temporary / MANIFEST_NAME, manifest.to_json().encode())
            ckpt_dir.commit(self._temporary, self._final, self.iteration)

        _on_rank0(commit, not self._collective or dist.get_rank() == 0, self._collective, self._temporary)
        return self._final   # nobody goes on (or loads) before the checkpoint is in place


def start_save(root: str | Path, *, cfg: MegaliteConfig, iteration: int, consumed_samples: int,
               parameters: list[tuple[str, torch.nn.Parameter]], optimizer: Optional[MegaliteOptimizer] = None,
               rng: Optional[TensorParallelRNG] = None, tokenizer: Optional[Tokenizer] = None,
               device: torch.device = torch.device("cpu"), asynchronous: bool = False,
               fp8_histories: list[tuple[str, Fp8History]] = ()) -> PendingSave:
    """Begin :func:`save_checkpoint`: this rank's tensors are written (``asynchronous``: copied, then written in the
    background) and what the manifest says is taken now; :meth:`PendingSave.finish` completes it.
    ``fp8_histories``: (canonical module name, history) of this rank's FP8 linears."""
    at = _Coordinates.registered()
    layout_size = at.tp * at.pp * at.dp
    if layout_size not in (1, world_size()):
        raise CheckpointError(f"saving needs a layout over the whole world or one process, not {layout_size} of "
                              f"{world_size()} ranks")
    collective = layout_size > 1
    is_writer = not collective or dist.get_rank() == 0
    final = ckpt_dir.iteration_dir(Path(root), iteration)

    tensors = _model_tensors(parameters, at)
    adam_step = _adam_step(optimizer)
    states = ({} if adam_step is None else
              _optimizer_tensors(optimizer, at, {id(param): name for name, param in parameters}))
    _refuse_non_finite(Path(root), iteration, tensors.values(), states.values(), collective, device)
    tensors.update(states)
    streams = _rng_states(rng, device)
    tensors.update({rng_key(at.pp_rank, at.tp_rank, at.dp_rank, s): state for s, state in streams.items()})
    if at.tp_rank == 0 and at.dp_rank == 0:
        tensors.update({fp8_key(name, item): value for name, history in fp8_histories
                        for item, value in history.state_dict().items()})
    manifest = Manifest(
        iteration=iteration, consumed_samples=consumed_samples,
        layout=SavedLayout.of(cfg, parallel_state.get_data_parallel_world_size()),   # pure DP: CP is its own field
        config=to_dict(cfg), params=_specs(cfg, parameters), adam_step=adam_step,
        loss_scaler=optimizer.scaler.state_dict() if optimizer is not None and optimizer.scaler else None,
        rng_streams=sorted(streams))

    temporary = _on_rank0(lambda: ckpt_dir.prepare(final), is_writer, collective, final)   # rank 0's name for it
    write = write_tensors(temporary, tensors, collective, asynchronous)
    return PendingSave(write, manifest, tokenizer, temporary, final, collective, device)


def _refuse_non_finite(root: Path, iteration: int, weights, states, collective: bool, device: torch.device) -> None:
    """Raise NotFiniteError on every rank, before anything is written or renamed, if a weight or an optimizer state
    this save would write holds a NaN or an infinity. A finite loss and gradient norm do not vouch for the weights:
    the step taken after them may have overflowed (a huge learning rate), and the next loss would tell too late, once
    this checkpoint had become the one --load picks. The cost: one pass over this rank's tensors at save time and
    one all-reduce of two flags, made on the compute device (an NCCL group carries CUDA tensors only) and read once."""
    bad = torch.stack([_any_not_finite(weights, device), _any_not_finite(states, device)]).float()
    if collective:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    bad_weights, bad_states = (bool(flag) for flag in bad.tolist())
    if not (bad_weights or bad_states):
        return
    what = "weights" if bad_weights else "optimizer states (Adam moments or fp32 main weights)"
    pointer = root / ckpt_dir.POINTER_NAME
    try:
        latest = str(ckpt_dir.iteration_dir(root, int(pointer.read_text())))
    except (OSError, ValueError):
        latest = f"none (no {pointer})"
    raise NotFiniteError(f"iteration {iteration}: the {what} are not finite (NaN/inf); the checkpoint was not saved; "
                         f"the latest good one is {latest}")


def _any_not_finite(tensors, device: torch.device) -> torch.Tensor:
    """Whether a floating-point tensor of ``tensors`` holds a NaN or an infinity, as a bool on ``device`` (a CPU
    tensor's answer, an offloaded optimizer's, is copied there), left there for the caller's one read."""
    flags = [torch.isfinite(t).all().logical_not().to(device) for t in tensors if t.is_floating_point()]
    return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=device)


def _on_rank0(step: Callable[[], object], is_writer: bool, collective: bool, directory: Path) -> object:
    """Run ``step`` (writing towards ``directory``) on rank 0, then a barrier that carries its failure: if rank 0
    cannot write (a full or read-only disk), every rank raises a SaveError, instead of the others waiting for it until
    the collective timeout. A CheckpointError (a bad tokenizer file name) stays one. Returns what ``step`` returned on
    rank 0, on every rank."""
    failure: Optional[Exception] = None
    result = None
    if is_writer:
        try:
            result = step()
        except Exception as error:
            failure = error
    if collective:
        outcome = [None if failure is None else f"{type(failure).__name__}: {failure}", result]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None and failure is None:
            raise SaveError(f"saving the checkpoint into {directory} failed on rank 0 ({outcome[0]})", str(directory))
        result = outcome[1]
    if isinstance(failure, OSError):
        raise SaveError(f"saving the checkpoint into {directory} failed ({type(failure).__name__}: {failure})",
                        str(directory)) from failure
    if failure is not None:
        raise failure
    return result


def _model_tensors(parameters, at: _Coordinates) -> dict[str, torch.Tensor]:
    """DP rank 0's whole TP slices (a ZeRO-3 shard is gathered over DP first: every DP rank takes part)."""
    tensors = {}
    for name, param in parameters:
        if getattr(param, "is_embedding_copy", False) or not stores_slice(param.partition, at.tp_rank):
            continue
        value = full_local_tensor(param)
        if at.replica(param) == 0:
            world, rank = slice_of(param.partition, at.tp_rank, at.tp)
            tensors[model_key(name, world, rank)] = value
    return tensors


def _adam_step(optimizer: Optional[MegaliteOptimizer]) -> Optional[int]:
    """Adam's step count (all pieces step together), or None before the first step (nothing to save)."""
    if optimizer is None:
        return None
    for piece in optimizer.pieces:
        state = optimizer.inner.state.get(piece.main)
        if state:
            return int(state["step"])
    return None


def _optimizer_tensors(optimizer: MegaliteOptimizer, at: _Coordinates,
                       names: dict[int, str]) -> dict[str, torch.Tensor]:
    engine = optimizer.engine
    tensors = {}
    for piece in optimizer.pieces:
        param = piece.param
        if getattr(param, "is_embedding_copy", False) or not stores_slice(param.partition, at.tp_rank):
            continue
        if not engine.distributed and at.replica(param) != 0:
            continue   # plain data parallel: every replica holds the same whole states
        if at.instance != 0:
            continue   # HSDP: the first instance's shards stand for every instance's
        world, rank = slice_of(param.partition, at.tp_rank, at.tp)
        param_start = engine.range(param)[0]
        lo, hi = piece.start - param_start, piece.end - param_start
        for kind, tensor in {"main": piece.main, **optimizer.piece_states(piece)}.items():
            tensors[optimizer_key(names[id(param)], world, rank, lo, hi, kind)] = tensor.detach()
    return tensors


def _rng_states(rng: Optional[TensorParallelRNG], device: torch.device) -> dict[str, torch.Tensor]:
    if rng is None:
        return {}
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    states["tensor_parallel"] = rng.get_states()[1].clone()   # the per-TP-rank dropout stream
    return states


def _specs(cfg: MegaliteConfig, parameters) -> dict[str, TensorSpec]:
    """Every parameter of the whole model (rank 0 holds only its stage: the rest comes from the meta model)."""
    dtype = str(next(p for _, p in parameters).dtype).removeprefix("torch.")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    specs = model_parameters(cfg.model)
    for name, param in parameters:   # the meta model must describe the real one
        if name not in specs or specs[name].full_shape != tuple(param.full_shape):
            raise RuntimeError(f"parameter {name} {list(param.full_shape)} is not in the model's description")
    # State that is not optimized (an expert bias) stays fp32 whatever the model dtype, and has no Adam states.
    return {name: TensorSpec(spec.full_shape, spec.partition, slice_of(spec.partition, 0, tp)[0],
                             dtype if spec.optimized else "float32", spec.optimized)
            for name, spec in specs.items()}


# The checkpoint's own files: a tokenizer file of one of these names would overwrite them.
_RESERVED = {MANIFEST_NAME, METADATA_NAME}


def _save_tokenizer(tokenizer: Optional[Tokenizer], directory: Path) -> dict[str, bytes]:
    """Write every file of ``tokenizer.files()`` into the checkpoint directory; returns them."""
    files = tokenizer.files() if tokenizer is not None else {}
    for name, data in files.items():
        if name in _RESERVED or name.endswith(".distcp") or Path(name).name != name or name.startswith("."):
            raise CheckpointError(f"tokenizer file name {name!r} cannot be stored in a checkpoint directory")
        ckpt_dir.write_file(directory / name, data)
    return files


def _tokenizer_entry(tokenizer: Optional[Tokenizer], files: dict[str, bytes]) -> Optional[dict]:
    """The manifest's description of the tokenizer: enough to compare it (fingerprint) and to rebuild it from the
    stored files (``file`` when there is one: the model path ``build_tokenizer`` takes, as tools/generate.py reads)."""
    if tokenizer is None:
        return None
    entry = {"type": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
             "fingerprint": tokenizer.fingerprint(), "files": sorted(files)}
    if len(files) == 1:
        entry["file"] = next(iter(files))
    return entry
