"""Convert megalite checkpoints to and from Hugging Face models and Megatron-LM checkpoints, and inspect them.

    python tools/convert_checkpoint.py export-hf --load CKPT_DIR --output HF_DIR     # config.json + model.safetensors
    python tools/convert_checkpoint.py import-hf --input HF_DIR --save CKPT_DIR      # then pretrain_gpt.py --load
    python tools/convert_checkpoint.py import-megatron --input SAVE_DIR --save CKPT_DIR   # torch_dist or legacy
    python tools/convert_checkpoint.py export-megatron --load CKPT_DIR --output SAVE_DIR [--ckpt-format torch]
        [--tensor-model-parallel-size N --pipeline-model-parallel-size M]    # Megatron-LM --load SAVE_DIR
    python tools/convert_checkpoint.py inspect --load CKPT_DIR     # a megalite or a Megatron-LM checkpoint
    python tools/convert_checkpoint.py verify --load CKPT_DIR      # every stored byte against the save's digests

CKPT_DIR is a checkpoint directory or a --save directory (its latest checkpoint), saved at any layout. The exported
directory loads with ``transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)``, vocabulary padding removed, and
its tokenizer (a Hugging Face or GPT-2 BPE one) with ``AutoTokenizer.from_pretrained(HF_DIR)``: a LlamaForCausalLM
if the model uses Llama options (rotary positions, RMSNorm, SwiGLU, no biases, grouped-query attention; it must then
use all but grouped-query attention), a Qwen2ForCausalLM if it also has q/k/v biases, a Qwen3ForCausalLM if it has
per-head q/k norms (--qk-layernorm), MistralForCausalLM with --architecture, a Gemma3ForCausalLM if it uses Gemma
options (--sandwich-norm, --scale-embeddings, --gated-linear-unit, ...; then all of them), else a GPT2LMHeadModel.
import-hf reads any of them, by the model_type of HF_DIR/config.json, with the directory's tokenizer. An imported checkpoint
is at iteration 0 with weights only; ``pretrain_gpt.py --load CKPT_DIR`` takes it at any layout, given the model
options of its config (``inspect`` shows them), and trains with its tokenizer when given --data-path without
tokenizer options. Needs ``safetensors``, ``tokenizers`` for a
tokenizer, and ``transformers`` to export a Llama-family model. verify checks that a checkpoint is complete and that
the manifest, DCP's index, every tensor and the tokenizer's files match the digests recorded at save (no model is
built); it exits 2 naming the first file and item that differ, or a checkpoint without digests (saved before
megalite recorded them) unless given --allow-unverified. import-megatron and export-megatron: see
megalite/checkpoint/megatron_lm (and the README's "Coming from Megatron-LM"): the export prints the Megatron
command-line words its --use-checkpoint-args does not take from a checkpoint. Errors are one line
``convert_checkpoint: error: ...`` and exit code 2 (megalite/config/tool.py); an output that cannot be created is
refused before any tensor is read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402

from megalite.checkpoint import verify_checkpoint  # noqa: E402
from megalite.checkpoint.convert import HF_ARCHITECTURES, export_hf, import_hf, inspect  # noqa: E402
from megalite.checkpoint.contents import open_checkpoint  # noqa: E402
from megalite.checkpoint.megatron_lm import (export_megatron, import_megatron, inspect_megatron,  # noqa: E402
                                             is_megatron_checkpoint)
from megalite.config.tool import check_writable, run_tool  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="convert_checkpoint", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export-hf", help="Write a Hugging Face model directory (GPT-2, Llama, Qwen2 or "
                                                     "Mistral, chosen from the model options) with its tokenizer.")
    export.add_argument("--load", required=True, metavar="CKPT_DIR", help="The megalite checkpoint.")
    export.add_argument("--output", required=True, metavar="HF_DIR", help="Directory to write.")
    export.add_argument("--dtype", choices=sorted(DTYPES), help="Weights' dtype (default: the checkpoint's).")
    export.add_argument("--architecture", choices=HF_ARCHITECTURES,
                        help="The Hugging Face architecture (default: from the model options; a Llama-shaped model "
                             "without biases may also be a MistralForCausalLM).")
    export.add_argument("--quiet", action="store_true", help="No progress bar.")
    imported = commands.add_parser("import-hf", help="Read a Hugging Face GPT-2, Llama, Mistral, Qwen2, Qwen3, "
                                                     "Gemma 3 (text), Mixtral, Qwen2-MoE or Qwen3-MoE directory "
                                                     "(and its tokenizer) into a checkpoint.")
    imported.add_argument("--input", required=True, metavar="HF_DIR",
                          help="config.json + model.safetensors, and tokenizer.json (or vocab.json + merges.txt).")
    imported.add_argument("--save", required=True, metavar="CKPT_DIR", help="Save directory of the checkpoint.")
    imported.add_argument("--quiet", action="store_true", help="No progress bar.")
    megatron_in = commands.add_parser("import-megatron", help="Read a Megatron-LM checkpoint (torch_dist or legacy "
                                                              "torch format, any layout) into a checkpoint.")
    megatron_in.add_argument("--input", required=True, metavar="SAVE_DIR",
                             help="Megatron's --save directory (its latest checkpoint) or one iter_* directory.")
    megatron_in.add_argument("--iteration", type=int, help="The iteration to read from SAVE_DIR (default: latest).")
    megatron_in.add_argument("--save", required=True, metavar="CKPT_DIR", help="Save directory of the checkpoint.")
    megatron_in.add_argument("--quiet", action="store_true", help="No progress bar.")
    megatron_out = commands.add_parser("export-megatron", help="Write a Megatron-LM --save directory that Megatron "
                                                               "loads with --use-checkpoint-args.")
    megatron_out.add_argument("--load", required=True, metavar="CKPT_DIR", help="The megalite checkpoint.")
    megatron_out.add_argument("--output", required=True, metavar="SAVE_DIR", help="Directory to write.")
    megatron_out.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default="torch_dist",
                              help="Megatron's format: torch_dist (its default; loads at any layout) or the legacy "
                                   "torch format (loads at the layout written).")
    megatron_out.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="N")
    megatron_out.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="M")
    megatron_out.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, metavar="V")
    megatron_out.add_argument("--expert-model-parallel-size", type=int, default=1, metavar="E")
    megatron_out.add_argument("--dtype", choices=sorted(DTYPES), help="Weights' dtype (default: the checkpoint's).")
    megatron_out.add_argument("--quiet", action="store_true", help="No progress bar.")
    inspect = commands.add_parser("inspect", help="Print iteration, layout, config and tensor shapes (of a Megatron-LM "
                                                  "checkpoint: its format, stored args and whole tensors).")
    inspect.add_argument("--load", required=True, metavar="CKPT_DIR", help="The megalite or Megatron-LM checkpoint.")
    verify = commands.add_parser("verify", help="Check that every stored byte matches the digests of the save.")
    verify.add_argument("--load", required=True, metavar="CKPT_DIR", help="The megalite checkpoint.")
    verify.add_argument("--allow-unverified", action="store_true",
                        help="Accept a checkpoint without digests (saved before megalite recorded them): only its "
                             "completeness is checked (default: it fails verification).")
    verify.add_argument("--quiet", action="store_true", help="No progress bar.")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    return run_tool("convert_checkpoint", lambda: convert(args))


def convert(args: argparse.Namespace) -> int:
    """The command's work; run_tool reports its errors."""
    if args.command in ("export-hf", "export-megatron"):
        check_writable(args.output, directory=True)   # before any tensor is read
    elif args.command in ("import-hf", "import-megatron"):
        check_writable(args.save, directory=True)
    if args.command == "export-hf":
        out = export_hf(args.load, args.output, DTYPES.get(args.dtype), args.architecture,
                        progress=not args.quiet)
        architecture = json.loads((out / "config.json").read_text())["architectures"][0]
        tokenizer = ("a tokenizer for AutoTokenizer" if (out / "tokenizer_config.json").is_file()
                     else "no tokenizer AutoTokenizer reads")
        print(f"wrote {out} ({architecture}: config.json, model.safetensors; {tokenizer})")
    elif args.command == "import-hf":
        path = import_hf(args.input, args.save, progress=not args.quiet)
        tokenizer = open_checkpoint(path).manifest.tokenizer
        print(f"wrote {path} (" + (f"tokenizer {tokenizer['type']}, {tokenizer['vocab_size']} ids" if tokenizer
                                   else "no tokenizer") + ")")
    elif args.command == "import-megatron":
        imported = import_megatron(args.input, args.save, args.iteration, progress=not args.quiet)
        tokenizer = imported.tokenizer
        print(f"wrote {imported.path} from {imported.source} ({imported.format} format, Megatron iteration "
              f"{imported.iteration}; " + (f"tokenizer {type(tokenizer).__name__}, {tokenizer.vocab_size} ids"
                                           if tokenizer else "no tokenizer") + ")")
        for note in imported.notes:
            print(f"note: {note}")
    elif args.command == "export-megatron":
        directory, flags = export_megatron(
            args.load, args.output, args.ckpt_format, args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size, args.num_virtual_stages_per_pipeline_rank,
            args.expert_model_parallel_size, DTYPES.get(args.dtype), progress=not args.quiet)
        print(f"wrote {directory} ({args.ckpt_format} format); Megatron-LM loads it with: --load {args.output} "
              f"--use-checkpoint-args --no-load-optim --no-load-rng" + "".join(f" {f}" for f in flags))
    elif args.command == "verify":
        print(verify_checkpoint(args.load, progress=not args.quiet, allow_unverified=args.allow_unverified))
    elif is_megatron_checkpoint(args.load):
        print(inspect_megatron(args.load))
    else:
        print(inspect(args.load))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
