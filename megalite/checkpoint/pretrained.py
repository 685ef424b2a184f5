"""``megalite.load_pretrained(dir)``: a checkpoint as one single-process model, whatever layout it was saved at.

The model is a whole :class:`GPTModel` (every layer, tensor-parallel size 1) in eval mode, wrapped so that calling it
on token ids [batch, seq] returns logits [batch, seq, vocab] with the vocabulary padding removed; ``generate``
continues a prompt with a KV cache, ``tokenizer()`` is the checkpoint's tokenizer. Megalite's layers
ask the registered layout for their tensor-parallel group; when no layout is registered (a plain script or notebook),
a 1x1x1 one is registered just for the construction and for each call, so loading leaves no global state behind.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megalite import parallel_state
from megalite.checkpoint.contents import Checkpoint, open_checkpoint
from megalite.checkpoint.load import load_weights
from megalite.checkpoint.model_specs import check_fits
from megalite.config import MegaliteConfig
from megalite.checkpoint.tokenizer import saved_tokenizer
from megalite.data.tokenizer import NullTokenizer, Tokenizer
from megalite.generation import generate
from megalite.model import GPTModel, KVCache
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
        self._checkpoint = checkpoint

    def forward(self, tokens: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        """Logits [batch, seq, vocab]; with a ``cache``, ``tokens`` continue the cached ones (see KVCache)."""
        with single_process_layout():
            return self.gpt.full_logits(tokens, cache)

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the checkpoint was trained with (its files are in the checkpoint); token ids as text
        (NullTokenizer) when it was trained on mock data or imported without one."""
        return saved_tokenizer(self._checkpoint) or NullTokenizer(self.vocab_size)

    @property
    def eod(self) -> Optional[int]:
        return (self._tokenizer_info or {}).get("eod")

    def generate(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, use_cache: bool = True) -> list[int]:
        """Token ids continuing ``prompt`` (ids), greedy by default, stopping after EOD; with a KV cache unless
        ``use_cache`` is False (the same tokens, each costing the whole context)."""
        device = next(self.gpt.parameters()).device
        with single_process_layout():   # once, not per token
            return generate(self, prompt, max_new_tokens, self.config.model.max_positions, temperature, top_k,
                            top_p, eod=self.eod, seed=seed, use_cache=use_cache, device=device)


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
