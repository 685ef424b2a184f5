"""Megatron-LM's checkpoint directories, read and written without Megatron installed.

A ``--save`` directory holds ``latest_checkpointed_iteration.txt`` (an iteration number, or ``release``) and one
``iter_NNNNNNN`` (or ``release``) directory per save, in one of two formats:

- **torch_dist** (Megatron's default since 2024): ``common.pt`` (the args Namespace, iteration, version),
  ``metadata.json`` and a torch.distributed.checkpoint directory (``.metadata``, ``__R_N.distcp``). Its tensors are
  whole, under spec-independent keys with layers stacked on a leading axis (``decoder.layers.self_attention.
  linear_qkv.weight`` is [layers, qkv rows, hidden]) and experts on the next (``decoder.layers.mlp.experts.experts.
  linear_fc1.weight``); norms use Transformer Engine's names (``linear_qkv.layer_norm_weight``). Each linear's
  ``_extra_state`` (FP8 metadata, None without Transformer Engine) is a pickled object beside them.
- **torch** (legacy): ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per tensor, pipeline and expert rank, each a
  pickled dict of args, iteration and ``model`` (``model0``, ``model1``... per virtual stage): that rank's shards,
  layers numbered from 0 on each stage and virtual stage, experts from 0 on each expert rank.

Both are read into Megatron's whole state dict (see :mod:`.tensors`). Pickles are opened by :func:`safe_load`,
which builds tensors, containers and argparse Namespaces and stands in an inert placeholder for any other class
(Megatron's enums, numpy's RNG states, optimizer objects), so reading runs no code from the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pickle
import re
import types
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from megalite.checkpoint.directory import (MEGATRON_COMMON as COMMON, MEGATRON_FORMAT_FILE as DIST_METADATA,
                                           MEGATRON_RANK_DIR as _RANK_DIRECTORY, POINTER_NAME, megatron_format)
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.megatron_lm.tensors import EXPERT, LAYER, join, local_name, split_dim, cut

TRACKER = POINTER_NAME   # Megatron's name, which megalite's own directories use too
LEGACY_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
# The torch_dist keys (inside ``decoder.layers.``) of the local spec's names that differ.
_DIST_NORMS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
               ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
_DIST_EXPERTS = "mlp.experts.experts."
_LOCAL_EXPERTS = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.*)")
# The modules whose ``_extra_state`` Megatron's local spec saves (and a strict load expects).
_LINEAR = re.compile(r"(.*\.(linear_qkv|linear_proj|linear_fc1|linear_fc2))\.weight")


# ---------------------------------------------------------------------------------------------------------- pickles

class _Placeholder:
    """Whatever a pickle names that is not a tensor, container or Namespace: its arguments kept, nothing run."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


_ALLOWED = {("collections", "OrderedDict"), ("argparse", "Namespace"), ("_codecs", "encode"),
            ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
            ("torch._utils", "_rebuild_parameter_with_state"), ("torch", "Size"),
            ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"),
            ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        return type(name, (_Placeholder,), {"__module__": module})


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=lambda f, **kw: _Unpickler(f, **kw).load(),
                                __name__="megalite_safe_pickle")


def safe_load(path: Path) -> Any:
    """A torch.save file's contents on CPU, every class outside tensors and plain containers a placeholder."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None


# ------------------------------------------------------------------------------------------------------- directories

@dataclasses.dataclass(frozen=True)
class MegatronCheckpoint:
    """One saved iteration of a Megatron-LM run."""
    path: Path         # the iter_NNNNNNN (or release) directory
    format: str        # "torch_dist" or "torch"

    @functools.cached_property
    def common(self) -> dict:
        """The non-tensor state: args, iteration, checkpoint_version (rank 0's file of a legacy checkpoint), read
        once (a legacy file holds that rank's tensors too)."""
        if self.format == "torch_dist":
            return safe_load(self.path / COMMON)
        return safe_load(self._rank_directories()[0][1])

    def args(self) -> argparse.Namespace:
        args = self.common.get("args")
        if not isinstance(args, argparse.Namespace):
            raise CheckpointError(f"{self.path}: the checkpoint stores no args (Megatron-LM saves them unless "
                                  f"told not to): the model options are unknown")
        return args

    def _rank_directories(self) -> list[tuple[re.Match, Path]]:
        found = []
        for directory in sorted(self.path.iterdir()):
            match = _RANK_DIRECTORY.fullmatch(directory.name)
            if match and (directory / LEGACY_FILE).is_file():
                found.append((match, directory / LEGACY_FILE))
        if not found:
            raise CheckpointError(f"{self.path}: no mp_rank_*/{LEGACY_FILE}")
        return found

    def rank_files(self) -> list[tuple[tuple[int, int, int], Path]]:
        """((tensor rank, pipeline rank, expert rank), file) of a legacy checkpoint, sorted (one 3-digit suffix is
        the pipeline rank when the args say there is a pipeline, else the expert rank)."""
        pipeline = getattr(self.common.get("args"), "pipeline_model_parallel_size", 1) > 1
        ranks = []
        for match, file in self._rank_directories():
            tp, first, second = int(match[1]), match[2], match[3]
            pp, ep = (int(first or 0), int(second or 0)) if pipeline else (0, int(first or 0))
            ranks.append(((tp, pp, ep), file))
        return sorted(ranks)


def _iteration_directory(path: Path, iteration: Optional[int]) -> Path:
    """The iteration directory ``path`` names: itself, or the latest (or ``iteration``) of a --save directory."""
    if iteration is not None:
        return path / f"iter_{iteration:07d}"
    if not (path / TRACKER).is_file():
        return path
    text = (path / TRACKER).read_text().strip()
    if text != "release" and not text.isdigit():
        raise CheckpointError(f"{path / TRACKER}: {text!r} is neither an iteration nor 'release'")
    return path / ("release" if text == "release" else f"iter_{int(text):07d}")


def is_megatron_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a Megatron-LM --save directory or one of its iteration directories."""
    try:
        return Path(path).is_dir() and megatron_format(_iteration_directory(Path(path), None)) is not None
    except (CheckpointError, OSError):
        return False


def open_megatron(path: str | Path, iteration: Optional[int] = None) -> MegatronCheckpoint:
    """The checkpoint of a --save directory (its latest, or ``iteration``) or of one iteration directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    directory = _iteration_directory(path, iteration)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such directory (the save is incomplete or the iteration wrong)")
    kind = megatron_format(directory)
    if kind is None:
        raise CheckpointError(f"{directory}: not a Megatron-LM checkpoint (no {COMMON} and {DIST_METADATA}, no "
                              f"mp_rank_* directories)")
    if kind not in ("torch_dist", "torch"):
        raise CheckpointError(f"{directory}: Megatron's {kind!r} checkpoint format: megalite reads torch_dist and the "
                              f"legacy torch format")
    return MegatronCheckpoint(directory, kind)


# ----------------------------------------------------------------------------------------------------------- reading

def _stage_offsets(args: argparse.Namespace) -> dict[tuple[int, int], int]:
    """(pipeline rank, virtual stage) -> the global index of its first layer, for Megatron's even split."""
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
                 "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        if getattr(args, name, None) is not None:
            raise CheckpointError(f"the legacy checkpoint splits its layers unevenly over the pipeline ({name}): "
                                  f"megalite reads even splits (a torch_dist checkpoint of it reads at any split)")
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    per_chunk = args.num_layers // (pp * vpp)
    return {(p, v): v * (args.num_layers // vpp) + p * per_chunk for p in range(pp) for v in range(vpp)}


def _chunks(state: dict) -> list[dict]:
    """The model state dicts of a legacy file, one per virtual stage."""
    if "model" in state:
        return [state["model"]]
    keys = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    return [state[k] for k in keys]


def read_legacy(checkpoint: MegatronCheckpoint, args: argparse.Namespace, gated: bool) -> dict[str, torch.Tensor]:
    """Megatron's whole state dict from the legacy per-rank files."""
    offsets = _stage_offsets(args)
    experts = getattr(args, "num_experts", None) or 0
    ep = getattr(args, "expert_model_parallel_size", 1)
    expert_tp = getattr(args, "expert_tensor_parallel_size", None) or getattr(args, "tensor_model_parallel_size", 1)
    tp = getattr(args, "tensor_model_parallel_size", 1)
    if expert_tp not in (1, tp):
        raise CheckpointError(f"the legacy checkpoint splits experts over {expert_tp} tensor ranks and the rest over "
                              f"{tp}: megalite reads expert TP of 1 or the TP size")
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for (tp_rank, pp_rank, ep_rank), file in checkpoint.rank_files():
        for v, chunk in enumerate(_chunks(safe_load(file))):
            for name, tensor in chunk.items():
                if name.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
                    continue
                name = local_name(name)
                layer = LAYER.fullmatch(name)
                if layer:
                    name = f"decoder.layers.{offsets[pp_rank, v] + int(layer[1])}.{layer[2]}"
                expert = EXPERT.fullmatch(name)
                if expert:
                    name = f"{expert[1]}{ep_rank * (experts // ep) + int(expert[2])}{expert[3]}"
                    if expert_tp == 1 and tp_rank > 0:
                        continue
                elif ep_rank > 0:
                    continue   # dense tensors: the same in every expert rank's file
                shards.setdefault(name, {})[tp_rank] = tensor
    whole = {}
    for name, by_rank in shards.items():
        how = split_dim(name, gated)
        if how is not None and EXPERT.fullmatch(name) and expert_tp == 1:
            how = None
        whole[name] = join([by_rank[r] for r in sorted(by_rank)], how)
    return whole


def _layer_tensors(key: str, tensor: torch.Tensor, chunks) -> tuple[str, dict[int, torch.Tensor]]:
    """(the name inside a layer, {layer: its tensor}) of a torch_dist key under ``decoder.layers``: a key of one layer
    (``decoder.layers.3.x``: Megatron's non-homogeneous layers) or one stacked over the layers, of which the layers
    some chunk covers (a dense layer has no place in an expert key)."""
    per_layer = LAYER.fullmatch(key)
    if per_layer:
        return per_layer[2], {int(per_layer[1]): tensor}
    covered = {c.offsets[0] + i for c in chunks for i in range(c.sizes[0])}
    return key[len("decoder.layers."):], {layer: tensor[layer] for layer in sorted(covered)}


def read_dist(checkpoint: MegatronCheckpoint) -> dict[str, torch.Tensor]:
    """Megatron's whole state dict from a torch_dist directory: every stored tensor read whole, then the stacked
    layer (and expert) axes taken apart."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415

    reader = dcp.FileSystemReader(str(checkpoint.path))
    metadata = reader.read_metadata()
    tensors = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    stored = {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in tensors.items()}
    try:
        dcp.load(stored, storage_reader=reader, no_dist=True)
    except Exception as error:   # DCP wraps every failure of its readers in its own exception types
        raise CheckpointError(f"{checkpoint.path}: unreadable torch_dist checkpoint ({error})") from None
    whole = {}
    for key, tensor in stored.items():
        if not key.startswith("decoder.layers."):
            whole[key] = tensor
            continue
        suffix, layers = _layer_tensors(key, tensor, tensors[key].chunks)
        for layer, value in layers.items():
            if suffix.startswith(_DIST_EXPERTS):
                for e in range(value.shape[0]):
                    name = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{suffix[len(_DIST_EXPERTS):]}"
                    whole[local_name(name)] = value[e].clone()
            else:
                whole[local_name(f"decoder.layers.{layer}.{suffix}")] = value.clone()
    return whole


# ----------------------------------------------------------------------------------------------------------- writing

def _common(args: argparse.Namespace) -> dict:
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": args.iteration,
            "num_floating_point_operations_so_far": 0}


def non_homogeneous(args: argparse.Namespace) -> bool:
    """Whether Megatron keys this model's torch_dist tensors per layer (``decoder.layers.3.x``) rather than stacked
    over the layers: when dense and MoE layers alternate, by --moe-layer-freq (a pattern, or one MoE layer in k>1)."""
    frequency = getattr(args, "moe_layer_freq", 1)
    return bool(getattr(args, "num_experts", None)) and (isinstance(frequency, list) or frequency > 1)


def _dist_key(name: str, per_layer: bool) -> tuple[str, tuple[int, ...]]:
    """The torch_dist key of a whole-state-dict name and its index on the key's stacked axes ((layer,) or
    (layer, expert) when stacked over the layers; (expert,) or () when keyed per layer)."""
    layer = LAYER.fullmatch(name)
    if layer is None:
        return name, ()
    prefix, stacked = ("decoder.layers.", (int(layer[1]),)) if not per_layer else (f"decoder.layers.{layer[1]}.", ())
    suffix = layer[2]
    expert = _LOCAL_EXPERTS.fullmatch(suffix)
    if expert:
        return f"{prefix}{_DIST_EXPERTS}{expert[2]}", (*stacked, int(expert[1]))
    for local, dist in _DIST_NORMS:
        if suffix.startswith(local):
            suffix = dist + suffix[len(local):]
    return prefix + suffix, stacked


def write_dist(directory: Path, whole: dict[str, torch.Tensor], args: argparse.Namespace) -> None:
    """A torch_dist directory holding ``whole`` as Megatron keys it (see :func:`non_homogeneous`), each linear's
    empty extra state beside it."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    per_layer = non_homogeneous(args)
    tied = not args.untie_embeddings_and_output_weights
    stacked: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    state: dict[str, Any] = {}

    def axes(key: str) -> list[int]:   # the sizes of a key's stacked axes
        return ([] if per_layer else [args.num_layers]) + ([args.num_experts] if _DIST_EXPERTS in key else [])

    for name, tensor in whole.items():
        if tied and name == "output_layer.weight":
            continue   # Megatron's torch_dist stores the tied weight once, as the embedding
        key, index = _dist_key(name, per_layer)
        stacked.setdefault(key, {})[index] = tensor
    for key, pieces in stacked.items():
        if () in pieces:
            state[key] = pieces[()]
            continue
        first = next(iter(pieces.values()))
        full = first.new_zeros(*axes(key), *first.shape)
        for index, tensor in pieces.items():
            full[index] = tensor
        state[key] = full
    for name in whole:
        linear = _LINEAR.fullmatch(name)
        if linear and LAYER.fullmatch(name):
            key, index = _dist_key(linear[1] + ".weight", per_layer)
            index, shape = (index, axes(key)) if index else ((0,), [1])
            # A module's extra state without Transformer Engine is None; dist_checkpointing stores an object as the
            # pickled list of its value, under its offsets and sizes on the stacked axes.
            state[f"{key[:-len('.weight')]}._extra_state/shard_{'.'.join(map(str, index))}_"
                  f"{'.'.join(map(str, shape))}"] = [None]
    directory.mkdir(parents=True, exist_ok=True)
    # Unflattened, as Megatron saves (its loader maps every stored key back itself; DCP's flattening records a
    # mapping that makes it hand an object back bare instead of in the list Megatron expects).
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)),
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    torch.save(_common(args), directory / COMMON)
    (directory / DIST_METADATA).write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                       "common_backend": "torch", "common_backend_version": 1}))


def write_legacy(directory: Path, whole: dict[str, torch.Tensor], args: argparse.Namespace, gated: bool) -> None:
    """One mp_rank_* file per tensor, pipeline and expert rank, as Megatron's legacy save writes them."""
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size or 1
    offsets = _stage_offsets(args)
    per_chunk = args.num_layers // (pp * vpp)
    local_experts = (args.num_experts or 0) // ep
    tied = not args.untie_embeddings_and_output_weights
    for p in range(pp):
        for e in range(ep):
            chunks = [[{} for _ in range(vpp)] for _ in range(tp)]
            for v in range(vpp):
                first, last = p == 0 and v == 0, p == pp - 1 and v == vpp - 1
                for name, tensor in whole.items():
                    local = _local_name(name, offsets[p, v], per_chunk, e, local_experts, first, last)
                    if local is None or (local == "output_layer.weight" and tied and first):
                        continue   # a tied output layer on the embedding's stage has no weight of its own
                    for t, shard in enumerate(cut(tensor, split_dim(name, gated), tp)):
                        chunks[t][v][local] = shard.clone()
                        linear = _LINEAR.fullmatch(local)
                        if linear:
                            chunks[t][v][linear[1] + "._extra_state"] = None
                if last:
                    for t in range(tp):
                        chunks[t][v]["output_layer._extra_state"] = None
            for t in range(tp):
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                models = {"model": chunks[t][0]} if vpp == 1 else {f"model{v}": c for v, c in enumerate(chunks[t])}
                (directory / name).mkdir(parents=True, exist_ok=True)
                torch.save({**_common(args), **models}, directory / name / LEGACY_FILE)


def _local_name(name: str, offset: int, per_chunk: int, ep_rank: int, local_experts: int, first: bool,
                last: bool) -> Optional[str]:
    """The name of ``name`` in the file of one pipeline chunk and expert rank, or None if it is not there."""
    layer = LAYER.fullmatch(name)
    if layer is None:
        if name.startswith("embedding."):
            return name if first else None
        return name if last else None
    index = int(layer[1]) - offset
    if not 0 <= index < per_chunk:
        return None
    local = f"decoder.layers.{index}.{layer[2]}"
    expert = EXPERT.fullmatch(local)
    if expert:
        owner, slot = divmod(int(expert[2]), local_experts)
        return f"{expert[1]}{slot}{expert[3]}" if owner == ep_rank else None
    return local


def write_tracker(save: Path, iteration: int) -> None:
    (save / TRACKER).write_text(f"{iteration}\n")


def iteration_directory(save: Path, iteration: int) -> Path:
    return save / f"iter_{iteration:07d}"


def describe(checkpoint: MegatronCheckpoint, shapes: Iterable[tuple[str, list[int]]]) -> list[str]:
    """Lines for ``inspect``: the format, the stored args and the tensors."""
    common = checkpoint.common
    args = common.get("args")
    lines = [f"Megatron-LM checkpoint: {checkpoint.path}", f"format: {checkpoint.format}",
             f"iteration: {common.get('iteration')}", f"checkpoint_version: {common.get('checkpoint_version')}",
             "args:"]
    lines += [f"  {k}={v!r}" for k, v in sorted(vars(args).items())] if isinstance(args, argparse.Namespace) else \
        ["  (none stored)"]
    shapes = list(shapes)
    lines.append(f"tensors ({len(shapes)}, whole, vocabulary padded):")
    width = max((len(n) for n, _ in shapes), default=0)
    lines += [f"  {n:<{width}}  {s}" for n, s in shapes]
    return lines
