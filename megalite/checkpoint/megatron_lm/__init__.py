"""Megatron-LM's checkpoints in and out: ``tools/convert_checkpoint.py import-megatron`` / ``export-megatron``.

An import reads a Megatron-LM save (torch_dist or legacy torch format, any TP, PP, virtual-pipeline and EP size)
into a single-process megalite checkpoint at iteration 0 (weights only, fp32), with the tokenizer its args name
when those files are on this machine; ``pretrain_gpt.py --load`` then reshards it to any layout. The model options
come from the args Namespace Megatron stores (:mod:`.args`), the tensors through Megatron's whole state dict
(:mod:`.files`, :mod:`.tensors`). An export writes a directory Megatron-LM loads with ``--load DIR
--use-checkpoint-args --no-load-optim --no-load-rng`` at the layout it was written for (torch_dist reshards on load
in Megatron too), args Namespace included; :func:`export_megatron` also returns the flags Megatron's
--use-checkpoint-args does not take from a checkpoint, which the Megatron command line must give.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

import torch

from megalite.checkpoint.contents import open_checkpoint
from megalite.checkpoint.convert import canonical_shapes, full_tensors, save_canonical
from megalite.checkpoint.errors import CheckpointError
from megalite.checkpoint.megatron_lm import args as megatron_args
from megalite.checkpoint.megatron_lm import files, tensors
from megalite.checkpoint.megatron_lm.files import is_megatron_checkpoint, open_megatron
from megalite.checkpoint.tokenizer import saved_tokenizer
from megalite.config import ConfigError, ModelConfig
from megalite.config.dims import ParallelDims
from megalite.data.tokenizer import Tokenizer, build_tokenizer, tokenizer_options_for
from megalite.data import DataError

__all__ = ["export_megatron", "import_megatron", "inspect_megatron", "is_megatron_checkpoint"]

FORMATS = ("torch_dist", "torch")
NULL_TOKENIZER = "NullTokenizer"


@dataclasses.dataclass(frozen=True)
class Imported:
    path: Path                    # the megalite checkpoint written
    source: Path                  # the Megatron iteration directory read
    format: str
    iteration: int                # Megatron's
    tokenizer: Optional[Tokenizer]
    notes: tuple[str, ...]


def _tokenizer(args) -> tuple[Optional[Tokenizer], int, list[str]]:
    """The tokenizer Megatron's args name (None when its files are not here), the true vocabulary size, notes."""
    kind = getattr(args, "tokenizer_type", None)
    padded = getattr(args, "padded_vocab_size", None)
    stated = getattr(args, "vocab_size", None)
    if kind == NULL_TOKENIZER and stated:
        return None, stated + 1, []   # Megatron's NullTokenizer adds its EOD after --vocab-size ids
    if kind not in (None, NULL_TOKENIZER):
        try:
            tokenizer = build_tokenizer(kind, getattr(args, "tokenizer_model", None), stated or 0,
                                        vocab_file=getattr(args, "vocab_file", None),
                                        merge_file=getattr(args, "merge_file", None))
            return tokenizer, tokenizer.vocab_size, []
        except (DataError, ConfigError, OSError) as error:
            note = f"tokenizer {kind} not loaded ({error}): imported without one"
        if stated:
            return None, stated, [note + f"; the vocabulary is --vocab-size {stated}"]
    else:
        note = "no tokenizer named in the args"
    if padded is None:
        raise CheckpointError("the Megatron args give neither padded_vocab_size nor vocab_size")
    return None, padded, [note + f"; the vocabulary is Megatron's padded {padded} ids"]


def import_megatron(source: str | os.PathLike, save: str | os.PathLike, iteration: Optional[int] = None,
                    progress: bool = True) -> Imported:
    """Read a Megatron-LM checkpoint (a --save directory's latest, or ``iteration``, or one iteration directory)
    into a megalite checkpoint under ``save``."""
    checkpoint = open_megatron(source, iteration)
    common = checkpoint.common
    args = checkpoint.args()
    megatron_args.refuse_unsupported(args)
    tokenizer, vocab_size, notes = _tokenizer(args)
    model = megatron_args.model_config(args, vocab_size)
    whole = (files.read_dist(checkpoint) if checkpoint.format == "torch_dist"
             else files.read_legacy(checkpoint, args, model.swiglu))
    canonical = tensors.to_canonical(whole, model, canonical_shapes(model))
    path = save_canonical(save, model, canonical, tokenizer, progress)
    return Imported(path, checkpoint.path, checkpoint.format, int(common.get("iteration") or 0), tokenizer,
                    tuple(notes))


def _write_tokenizer(tokenizer: Optional[Tokenizer], model: ModelConfig, output: Path) -> dict:
    """The tokenizer args of an export: its files written under ``output/tokenizer`` and named as Megatron's
    options name them, or Megatron's NullTokenizer of the model's vocabulary (its EOD the last id)."""
    if tokenizer is None:
        return {"tokenizer_type": NULL_TOKENIZER, "vocab_size": model.vocab_size - 1, "tokenizer_model": None}
    directory = output / "tokenizer"
    directory.mkdir(parents=True, exist_ok=True)
    for name, contents in tokenizer.files().items():
        (directory / name).write_bytes(contents)
    options = tokenizer_options_for(type(tokenizer).__name__, directory.resolve())
    return {"vocab_size": None, **options}


def export_megatron(load: str | os.PathLike, output: str | os.PathLike, ckpt_format: str = "torch_dist",
                    tp: int = 1, pp: int = 1, virtual_stages: Optional[int] = None, ep: int = 1,
                    dtype: Optional[torch.dtype] = None, progress: bool = True) -> tuple[Path, list[str]]:
    """Write the megalite checkpoint as a Megatron-LM --save directory saved at TP x PP (x EP, and ``virtual_stages``
    per pipeline rank) in ``ckpt_format``; returns its iteration directory and the flags Megatron's command line
    must add to --use-checkpoint-args."""
    if ckpt_format not in FORMATS:
        raise CheckpointError(f"--ckpt-format {ckpt_format}: Megatron-LM's formats megalite writes are "
                              f"{', '.join(FORMATS)}")
    checkpoint = open_checkpoint(load)
    checkpoint.verify()
    model = checkpoint.manifest.megalite_config().model
    dims = ParallelDims(tp * pp * ep, tp=tp, pp=pp, ep=ep)
    _check_layout(model, dims, virtual_stages)
    canonical = full_tensors(checkpoint, progress)
    dtype = dtype or next(iter(canonical.values())).dtype
    args = megatron_args.megatron_args(model, dims, virtual_stages, iteration=checkpoint.manifest.iteration,
                                       consumed_samples=checkpoint.manifest.consumed_samples,
                                       ckpt_format=ckpt_format, dtype=dtype)
    out = Path(output)
    vars(args).update(_write_tokenizer(saved_tokenizer(checkpoint), model, out))
    whole = {name: t.to(dtype) for name, t in
             tensors.from_canonical(canonical, model, args.padded_vocab_size).items()}
    directory = files.iteration_directory(out, args.iteration)
    if directory.exists():
        raise CheckpointError(f"{directory} exists: export into a new directory")
    if ckpt_format == "torch_dist":
        files.write_dist(directory, whole, args)
    else:
        directory.mkdir(parents=True)
        files.write_legacy(directory, whole, args, model.swiglu)
    files.write_tracker(out, args.iteration)
    flags = megatron_args.flags_not_taken(model)
    if args.tokenizer_type == NULL_TOKENIZER:
        flags.append(f"--vocab-size {args.vocab_size}")   # the NullTokenizer's size is not taken from a checkpoint
    return directory, flags


def _check_layout(model: ModelConfig, dims: ParallelDims, virtual_stages: Optional[int]) -> None:
    """CheckpointError unless Megatron can split this model at this layout evenly."""
    stages = dims.pp * (virtual_stages or 1)
    problems = [(model.num_layers % stages, f"{model.num_layers} layers over {stages} pipeline stages"),
                (model.num_attention_heads % dims.tp, f"{model.num_attention_heads} heads over TP {dims.tp}"),
                (model.query_groups % dims.tp, f"{model.query_groups} query groups over TP {dims.tp}"),
                ((model.num_experts or 0) % dims.ep, f"{model.num_experts} experts over EP {dims.ep}")]
    for remainder, what in problems:
        if remainder:
            raise CheckpointError(f"cannot split {what}")
    if virtual_stages is not None and dims.pp == 1:
        raise CheckpointError("virtual pipeline stages need a pipeline size above 1")


def inspect_megatron(path: str | os.PathLike, iteration: Optional[int] = None) -> str:
    """What ``inspect`` prints for a Megatron checkpoint: format, iteration, the stored args, the whole tensors."""
    checkpoint = open_megatron(path, iteration)
    args = checkpoint.args()
    whole = (files.read_dist(checkpoint) if checkpoint.format == "torch_dist"
             else files.read_legacy(checkpoint, args, bool(getattr(args, "swiglu", False))))
    return "\n".join(files.describe(checkpoint, ((n, list(t.shape)) for n, t in whole.items())))
