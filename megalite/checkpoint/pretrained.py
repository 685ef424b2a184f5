"""``megalite.load_pretrained(dir)``: a checkpoint as one single-process model, whatever layout it was saved at.

The model is a whole :class:`GPTModel` (every layer, tensor-parallel size 1) in eval mode, wrapped so that calling it
on token ids [batch, seq] returns logits [batch, seq, vocab] with the vocabulary padding removed. Megalite's layers
ask the registered layout for their tensor-parallel group; when no layout is registered (a plain script or notebook),
a 1x1x1 one is registered just for the construction and for each call, so loading leaves no global state behind.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from megalite import parallel_state
from megalite.checkpoint.contents import Checkpoint, open_checkpoint
from megalite.checkpoint.load import load_weights
from megalite.checkpoint.model_specs import check_fits
from megalite.config import MegaliteConfig
from megalite.data.tokenizer import Tokenizer, build_tokenizer
from megalite.model import GPTModel
from megalite.tensor_parallel import TensorParallelRNG


@contextlib.contextmanager
def single_process_layout() -> Iterator[None]:
    """Run the block under a 1x1x1 layout: the registered one if it is 1x1x1, else a temporary one."""
    if parallel_state.is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() != 1
                or parallel_state.get_pipeline_model_parallel_world_size() != 1):
            raise RuntimeError("a single-process model needs tensor- and pipeline-parallel size 1, but a parallel "
                               "layout is registered")
        yield
        return
    parallel_state.initialize_model_parallel(1, 1, ranks=[dist.get_rank()] if dist.is_initialized() else None)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


class PretrainedGPT(nn.Module):
    """A loaded checkpoint: ``model(tokens)`` -> logits over the unpadded vocabulary."""

    def __init__(self, gpt: GPTModel, config: MegaliteConfig, checkpoint: Checkpoint):
        super().__init__()
        self.gpt = gpt
        self.config = config
        self.vocab_size = config.model.vocab_size
        self.iteration = checkpoint.manifest.iteration
        self._tokenizer_info = checkpoint.manifest.tokenizer
        self._path = checkpoint.path

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with single_process_layout():
            return self.gpt.full_logits(tokens)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the checkpoint was trained with (a copy of its model is in the checkpoint); token ids as
        text (NullTokenizer) when it was trained on mock data or imported without one."""
        info = self._tokenizer_info or {"type": "NullTokenizer"}
        model_file = str(self._path / info["file"]) if "file" in info else None
        return build_tokenizer(info["type"], model_file, self.vocab_size)

    @property
    def eod(self) -> Optional[int]:
        return (self._tokenizer_info or {}).get("eod")


def load_pretrained(directory: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> PretrainedGPT:
    """The model of the checkpoint in ``directory`` (a checkpoint directory, or a --save directory: its latest),
    merged into one process, in eval mode. Only the weights are read; a missing piece is a CheckpointError."""
    checkpoint = open_checkpoint(directory)
    checkpoint.verify()
    config = checkpoint.manifest.megalite_config()
    with single_process_layout():
        check_fits(checkpoint.manifest, config.model, checkpoint.path)
        with torch.random.fork_rng(devices=[]):   # the dropout stream's seeding must not reseed the caller's RNG
            rng = TensorParallelRNG(config.training.seed, 0, 0, torch.device("cpu"))
            gpt = GPTModel(config.model, rng)
        load_weights(checkpoint, list(gpt.canonical_named_parameters()))
    return PretrainedGPT(gpt.to(device=device, dtype=dtype), config, checkpoint).eval()
