"""Checkpoints: each rank saves its own shards through torch.distributed.checkpoint, atomically; loading reshards to
any layout; conversion to and from Hugging Face GPT-2, Llama, Mistral and Qwen2 (tokenizers included) and
Megatron-LM's torch_dist and legacy checkpoints (``megatron_lm``);
``load_pretrained`` for single-process use.

``start_save`` / ``load_checkpoint`` are what the trainer calls; ``use_checkpoint_args`` and ``check_checkpoint`` what
``pretrain_gpt.py`` runs before any process group exists; ``verify_checkpoint`` checks every digest offline. The
layout on disk is described in ``directory``, the tensor names in ``keys``, the JSON table of contents in
``manifest``, the digests in ``digests``, what must match on resume in ``identity``.
"""

from megalite.checkpoint.contents import Checkpoint, open_checkpoint
from megalite.checkpoint.errors import CheckpointError, NotFiniteError
from megalite.checkpoint.identity import use_checkpoint_args
from megalite.checkpoint.load import LoadResult, check_checkpoint, load_checkpoint
from megalite.checkpoint.manifest import Manifest, SavedLayout, TensorSpec
from megalite.checkpoint.pretrained import PretrainedGPT, load_pretrained
from megalite.checkpoint.save import PendingSave, save_checkpoint, start_save
from megalite.checkpoint.tokenizer import saved_tokenizer, with_checkpoint_tokenizer
from megalite.checkpoint.verify import verify_checkpoint

__all__ = ["Checkpoint", "CheckpointError", "LoadResult", "Manifest", "NotFiniteError", "PendingSave", "PretrainedGPT",
           "SavedLayout", "TensorSpec", "check_checkpoint", "load_checkpoint", "load_pretrained", "open_checkpoint",
           "save_checkpoint", "saved_tokenizer", "start_save", "use_checkpoint_args", "verify_checkpoint",
           "with_checkpoint_tokenizer"]
