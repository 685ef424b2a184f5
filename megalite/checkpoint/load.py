"""Loading, at any layout: every rank reads the pieces of its own parameters and reshards them itself.

For each parameter of this rank (one at a time, to bound memory): read every stored TP slice, merge them into the
canonical tensor, cut this rank's slice for the current TP size. Optimizer states the same way, after gluing each
stored slice back together from the ranges the saving DP ranks owned; the current rank then keeps the ranges of its
own pieces. Reads are per rank (no collective), so any TP/PP/V/DP/distributed-optimizer combination loads from
any other. RNG states are restored only at the identical layout (elsewhere there is no rank they would belong to).

:func:`check_checkpoint` is the pre-flight ``pretrain_gpt.py`` runs on every rank before any process group exists:
the checkpoint is complete, its manifest and index match their digests, and it holds the same model
(:mod:`megalite.checkpoint.identity`). :func:`load_checkpoint` repeats that (cheap), checks that the checkpoint fits
the model, then verifies the stored bytes of everything the run will load against their digests before any of it is
used: the ranks of the layout split the items evenly by bytes, each hashes its share, and a mismatch found by one
stops every rank with its line. Only then are tensors read.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from megalite import parallel_state
from megalite.checkpoint import directory as ckpt_dir
from megalite.checkpoint.contents import NO_DIGESTS, Checkpoint, open_load_checkpoint
from megalite.checkpoint.digests import even_shares
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.identity import check_same_model
from megalite.checkpoint.keys import fp8_key, model_key, optimizer_key, optimizer_pieces, rng_key, stored_states
from megalite.checkpoint.manifest import Manifest, SavedLayout
from megalite.checkpoint.model_specs import check_fits
from megalite.checkpoint.reshard import assemble, merge, split
from megalite.config import CheckpointConfig, MegaliteConfig
from megalite.config.dims import ParallelDims
from megalite.data.tokenizer import Tokenizer
from megalite.distributed import copy_into_parameter
from megalite.optimizer import MegaliteOptimizer
from megalite.tensor_parallel import Fp8History, TensorParallelRNG


@dataclasses.dataclass
class LoadResult:
    path: Path
    iteration: int                 # where training resumes (0 with --finetune)
    consumed_samples: int
    notes: list[str]               # what was and was not restored, for rank 0 to print


def check_checkpoint(cfg: MegaliteConfig, world_size: int, tokenizer: Optional[Tokenizer] = None) -> None:
    """Raise a one-line CheckpointError if ``--load`` names no usable checkpoint, or one that misses anything this
    run would read, or holds another model than ``cfg``'s read with ``tokenizer`` (megalite.run resolved both: the
    vocabulary is the tokenizer's). Reads only the manifest and DCP's index; no process group needed. Also refuses a
    ``--save`` whose pointer names a newer iteration than the run starts from (see :func:`_check_not_behind`)."""
    c = cfg.checkpoint
    checkpoint = open_load_checkpoint(c) if c.load is not None else None
    if checkpoint is not None:
        layout = SavedLayout.of(cfg, ParallelDims.of(cfg.parallel, world_size).dp)
        checkpoint.verify(optimizer=_loads_optimizer(cfg, checkpoint.manifest),
                          rng=_loads_rng(cfg, checkpoint.manifest, layout, torch.cuda.is_available()))
        check_same_model(checkpoint, cfg.model, tokenizer, c.finetune)
    start = checkpoint.manifest.iteration if checkpoint is not None and not c.finetune else 0
    _check_not_behind(c, start)


def _check_not_behind(c: CheckpointConfig, start: int) -> None:
    """A run starting at iteration ``start`` whose --save already points to a later one (e.g. --load X/iter_5
    --save X with X at 10, maybe another run's) would replace those iterations and move the pointer back: refused
    unless --override-newer-checkpoint."""
    if c.save is None or c.override_newer_checkpoint:
        return
    newest = ckpt_dir.pointed_iteration(c.save)
    if newest is not None and newest > start:
        raise CheckpointError(
            f"--save {c.save} already points to iteration {newest}, newer than iteration {start} this run starts "
            f"from (its saves would overwrite checkpoints up to {newest} and move {ckpt_dir.POINTER_NAME} back): "
            f"choose another --save, or pass --override-newer-checkpoint")


def load_checkpoint(cfg: MegaliteConfig, *, parameters: list[tuple[str, torch.nn.Parameter]],
                    optimizer: Optional[MegaliteOptimizer], rng: Optional[TensorParallelRNG],
                    device: torch.device, tokenizer: Optional[Tokenizer] = None,
                    fp8_histories: list[tuple[str, Fp8History]] = ()) -> Optional[LoadResult]:
    """Load ``cfg.checkpoint.load`` into this rank's parameters, optimizer and RNG, after checking that it holds the
    model of ``cfg`` read with ``tokenizer`` and that its bytes match their digests (collective twice: to verify
    them together, and at the end to agree that every rank succeeded). None when there is nothing to load yet
    (--load equal to --save, first run)."""
    c = cfg.checkpoint
    checkpoint = open_load_checkpoint(c)
    if checkpoint is None:
        return None
    manifest = checkpoint.manifest
    dp = parallel_state.get_data_parallel_world_size()
    layout = SavedLayout.of(cfg, dp)
    with_optimizer = optimizer is not None and _loads_optimizer(cfg, manifest)
    with_rng = rng is not None and _loads_rng(cfg, manifest, layout, device.type == "cuda")
    checkpoint.verify(optimizer=with_optimizer, rng=with_rng)
    model_notes = check_same_model(checkpoint, cfg.model, tokenizer, c.finetune)
    check_fits(manifest, cfg.model, checkpoint.path)
    fp8_keys = _fp8_keys(checkpoint, fp8_histories) if not c.finetune else {}
    kinds = ("model/",) + ("optim/",) * with_optimizer + ("rng/",) * with_rng + ("fp8/",) * bool(fp8_keys)
    _verify_together(checkpoint, [key for key in checkpoint.metadata.state_dict_metadata if key.startswith(kinds)],
                     device)
    error: Optional[Exception] = None
    try:
        _load_parameters(checkpoint, parameters, optimizer, with_optimizer)
        if with_rng:
            _restore_rng(checkpoint, rng, device)
        _restore_fp8(checkpoint, fp8_histories, fp8_keys)
    except Exception as caught:   # e.g. unreadable tensor bytes, found by this rank alone: tell the others first
        error = caught
    _raise_on_every_rank(error, device)
    notes = _notes(cfg, manifest, layout, with_optimizer, with_rng, rng is not None) + model_notes
    if fp8_histories and not fp8_keys and not c.finetune:
        notes.append("FP8 amax histories: none in the checkpoint (saved without --fp8-recipe delayed): they start "
                     "afresh")
    if not checkpoint.has_digests:
        notes.append(NO_DIGESTS)
    if c.finetune:
        return LoadResult(checkpoint.path, 0, 0, notes)
    return LoadResult(checkpoint.path, manifest.iteration, manifest.consumed_samples, notes)


def load_weights(checkpoint: Checkpoint, parameters: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Model weights only, into parameters of the registered layout (``load_pretrained`` uses this)."""
    _load_parameters(checkpoint, parameters, None, False)


def _raise_on_every_rank(error: Optional[Exception], device: torch.device) -> None:
    """If any rank of the layout failed, raise on every rank: the same CheckpointError with the first failing rank's
    message (so each prints the same line), or on the failing rank its own error when it is not a CheckpointError."""
    message = parallel_state.first_message(None if error is None else str(error), device)
    if error is not None and not isinstance(error, CheckpointError):
        raise error
    if message is not None:
        raise CheckpointError(message)


def _verify_together(checkpoint: Checkpoint, keys: list[str], device: torch.device) -> None:
    """Check the stored bytes of ``keys`` against their digests, each rank of the layout an even share by bytes (in
    storage order, so each reads a contiguous run of a file), before anything is loaded."""
    if not checkpoint.has_digests:
        return
    ps = parallel_state
    tp, pp, dp = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                  ps.get_data_parallel_world_size())
    me = ((ps.get_pipeline_model_parallel_rank() * dp + ps.get_data_parallel_rank()) * tp
          + ps.get_tensor_model_parallel_rank())   # the rank's place in the layout (parallel_state's rank order)
    keys = checkpoint.in_storage_order(keys)
    start, end = even_shares(checkpoint.item_sizes(keys), tp * pp * dp)[me]
    error: Optional[CheckpointError] = None
    try:
        checkpoint.verify_contents(keys[start:end])
    except CheckpointError as caught:
        error = caught
    _raise_on_every_rank(error, device)
    checkpoint.mark_verified(keys)


# ---- what to load -------------------------------------------------------------------------------------------------
def _loads_optimizer(cfg: MegaliteConfig, manifest: Manifest) -> bool:
    c = cfg.checkpoint
    return manifest.has_optimizer and not c.finetune and not c.no_load_optim


def _same_ranks(a: SavedLayout, b: SavedLayout) -> bool:
    """RNG states belong to (pp, tp, dp, cp) ranks running the same chunks in the same order (the schedule): the
    optimizer's sharding does not matter."""
    return ((a.tp, a.pp, a.virtual_stages, a.dp, a.cp, a.pipeline_schedule)
            == (b.tp, b.pp, b.virtual_stages, b.dp, b.cp, b.pipeline_schedule))


def _loads_rng(cfg: MegaliteConfig, manifest: Manifest, layout: SavedLayout, cuda: bool) -> bool:
    c = cfg.checkpoint
    return (bool(manifest.rng_streams) and not c.finetune and not c.no_load_rng and _same_ranks(manifest.layout, layout)
            and ("cuda" in manifest.rng_streams) == cuda)


def _notes(cfg: MegaliteConfig, manifest: Manifest, layout: SavedLayout, with_optimizer: bool, with_rng: bool,
           has_rng: bool) -> list[str]:
    c = cfg.checkpoint
    notes = [f"saved at iteration {manifest.iteration} at {manifest.layout.describe()}, loaded at {layout.describe()}"]
    if c.finetune:
        notes.append("--finetune: model weights only, starting at iteration 0")
        return notes
    if not with_optimizer:
        why = "--no-load-optim" if c.no_load_optim else "the checkpoint has none"
        notes.append(f"optimizer state not loaded ({why}): Adam starts afresh")
    if has_rng and not with_rng and not c.no_load_rng:
        why = ("the checkpoint has none" if not manifest.rng_streams else
               "the layout differs" if not _same_ranks(manifest.layout, layout) else "the device type differs")
        notes.append(f"RNG states not restored ({why}): dropout draws continue from --seed")
    return notes


# ---- parameters and optimizer state -------------------------------------------------------------------------------
def _load_parameters(checkpoint: Checkpoint, parameters: list[tuple[str, torch.nn.Parameter]],
                     optimizer: Optional[MegaliteOptimizer], with_optimizer: bool) -> None:
    manifest = checkpoint.manifest
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    mine = defaultdict(list)   # this rank's optimizer pieces of each parameter
    for piece in (optimizer.pieces if optimizer is not None else []):
        mine[id(piece.param)].append(piece)
    stored = optimizer_pieces(checkpoint.metadata.state_dict_metadata) if with_optimizer else {}
    moments: dict[int, dict[str, torch.Tensor]] = {}
    for name, param in parameters:
        spec = manifest.params[name]
        model_keys = [model_key(name, spec.slices, r) for r in range(spec.slices)]
        wants_state = with_optimizer and bool(mine[id(param)])   # this rank updates some of it
        kinds = ("main",) + optimizer.state_kinds(param) if wants_state else ()
        if wants_state and (saved := stored_states(stored, name)) != kinds:
            raise CheckpointError(f"{checkpoint.path}: the optimizer state of {name} is {', '.join(saved[1:])}, this "
                                  f"run's optimizer keeps {', '.join(kinds[1:])} (saved with another --optimizer; "
                                  f"--no-load-optim starts a fresh one)")
        state_keys = {(state, r): [(lo, hi, optimizer_key(name, spec.slices, r, lo, hi, state))
                                   for lo, hi in stored[(name, spec.slices, r, state)]]
                      for state in kinds for r in range(spec.slices)}
        data = checkpoint.read(model_keys + [key for ranges in state_keys.values() for _, _, key in ranges])
        with torch.no_grad():
            full = merge([data[key] for key in model_keys], spec)
            copy_into_parameter(param, split(full, param.partition, tp_rank, tp))
            for piece in mine[id(param)]:
                if not with_optimizer and not piece.aliased:
                    piece.main.copy_(piece.model_view)   # fresh fp32 main copies of the loaded weights
            if not wants_state:
                continue
            shapes = spec.slice_shapes()
            param_start = optimizer.engine.range(param)[0]
            for state in kinds:
                slices = [assemble({(lo, hi): data[key] for lo, hi, key in state_keys[(state, r)]},
                                   data[model_keys[r]].numel()).view(shapes[r]) for r in range(spec.slices)]
                local = split(merge(slices, spec), param.partition, tp_rank, tp).view(-1)
                for piece in mine[id(param)]:
                    value = local[piece.start - param_start: piece.end - param_start]
                    if state == "main":
                        piece.main.copy_(value)
                        if not piece.aliased:
                            piece.model_view.copy_(piece.main)
                    else:
                        moments.setdefault(id(piece.main), {})[state] = value.clone()
    if with_optimizer:
        _install_moments(optimizer, moments, manifest)


def _install_moments(optimizer: MegaliteOptimizer, moments: dict[int, dict[str, torch.Tensor]],
                     manifest: Manifest) -> None:
    """Adam's state through the optimizer's own load_state_dict, which puts each tensor on its parameter's device
    and dtype; the step count is shared by every parameter. Muon's momentum buffers are copied into its own."""
    muon = optimizer.muon.pieces if optimizer.muon is not None else []
    for piece in muon:
        optimizer.muon.momentum_buffer(piece).copy_(moments.pop(id(piece.main))["momentum_buffer"])
    inner = optimizer.inner
    state_dict = inner.state_dict()
    ordered = [p for group in inner.param_groups for p in group["params"]]
    for index, main in enumerate(ordered):
        state_dict["state"][index] = {"step": torch.tensor(float(manifest.adam_step)), **moments[id(main)]}
    inner.load_state_dict(state_dict)
    scaler, saved = optimizer.scaler, manifest.loss_scaler
    # A constant --loss-scale stays the user's; a dynamic scaler continues from the saved one.
    if scaler is not None and saved is not None and set(saved) == set(scaler.state_dict()) and len(saved) > 1:
        scaler.load_state_dict(saved)


def _fp8_keys(checkpoint: Checkpoint, histories: list[tuple[str, Fp8History]]) -> dict[str, list[str]]:
    """Module name -> its history's keys, for the histories this checkpoint holds (at any layout: a history is the
    same on every rank holding its layer); empty when it holds none of them."""
    stored = checkpoint.metadata.state_dict_metadata
    found = {name: [fp8_key(name, item) for item in history.state_dict()] for name, history in histories}
    present = {name: keys for name, keys in found.items() if all(key in stored for key in keys)}
    if present and len(present) < len(found):
        missing = next(name for name in found if name not in present)
        raise CheckpointError(f"{checkpoint.path}: incomplete checkpoint: no FP8 amax history of {missing}")
    return present


def _restore_fp8(checkpoint: Checkpoint, histories: list[tuple[str, Fp8History]], keys: dict[str, list[str]]) -> None:
    if not keys:
        return
    values = checkpoint.read([key for name in keys for key in keys[name]])
    for name, history in histories:
        try:
            history.load_state_dict({key.rsplit("/", 1)[1]: values[key] for key in keys[name]})
        except ValueError as error:
            raise CheckpointError(f"{checkpoint.path}: {name}: {error}") from None


def _restore_rng(checkpoint: Checkpoint, rng: TensorParallelRNG, device: torch.device) -> None:
    at = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
          parallel_state.get_data_parallel_rank(with_context_parallel=True))
    states = checkpoint.read([rng_key(*at, stream) for stream in checkpoint.manifest.rng_streams])
    states = {key.rsplit("/", 1)[1]: value for key, value in states.items()}
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
    rng.set_states((rng.get_states()[0], states["tensor_parallel"]))   # the default stream was just restored

