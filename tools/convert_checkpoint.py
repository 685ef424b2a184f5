"""Convert megalite checkpoints to and from Hugging Face GPT-2, Llama, Mistral and Qwen2, and inspect them.

    python tools/convert_checkpoint.py export-hf --load CKPT_DIR --output HF_DIR     # config.json + model.safetensors
    python tools/convert_checkpoint.py import-hf --input HF_DIR --save CKPT_DIR      # then pretrain_gpt.py --load
    python tools/convert_checkpoint.py inspect --load CKPT_DIR
    python tools/convert_checkpoint.py verify --load CKPT_DIR      # every stored byte against the save's digests

CKPT_DIR is a checkpoint directory or a --save directory (its latest checkpoint), saved at any layout. The exported
directory loads with ``transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)``, vocabulary padding removed, and
its tokenizer (a Hugging Face or GPT-2 BPE one) with ``AutoTokenizer.from_pretrained(HF_DIR)``: a LlamaForCausalLM
if the model uses Llama options (rotary positions, RMSNorm, SwiGLU, no biases, grouped-query attention; it must then
use all but grouped-query attention), a Qwen2ForCausalLM if it also has q/k/v biases, MistralForCausalLM with
--architecture, else a GPT2LMHeadModel. import-hf reads any of them, by the model_type of HF_DIR/config.json, with
the directory's tokenizer. An imported checkpoint is at iteration 0 with weights only; ``pretrain_gpt.py --load
CKPT_DIR`` takes it at any layout, given the model options of its config (``inspect`` shows them), and trains with
its tokenizer when given --data-path without tokenizer options. Needs ``safetensors``, ``tokenizers`` for a
tokenizer, and ``transformers`` to export a Llama-family model. verify checks that a checkpoint is complete and that
the manifest, DCP's index, every tensor and the tokenizer's files match the digests recorded at save (no model is
built); it exits 2 naming the first file and item that differ.
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
from megalite.config import ConfigError  # noqa: E402

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
    imported = commands.add_parser("import-hf", help="Read a Hugging Face GPT-2, Llama, Mistral or Qwen2 directory "
                                                     "(and its tokenizer) into a checkpoint.")
    imported.add_argument("--input", required=True, metavar="HF_DIR",
                          help="config.json + model.safetensors, and tokenizer.json (or vocab.json + merges.txt).")
    imported.add_argument("--save", required=True, metavar="CKPT_DIR", help="Save directory of the checkpoint.")
    imported.add_argument("--quiet", action="store_true", help="No progress bar.")
    inspect = commands.add_parser("inspect", help="Print iteration, layout, config and tensor shapes.")
    inspect.add_argument("--load", required=True, metavar="CKPT_DIR", help="The megalite checkpoint.")
    verify = commands.add_parser("verify", help="Check that every stored byte matches the digests of the save.")
    verify.add_argument("--load", required=True, metavar="CKPT_DIR", help="The megalite checkpoint.")
    verify.add_argument("--quiet", action="store_true", help="No progress bar.")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
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
        elif args.command == "verify":
            print(verify_checkpoint(args.load, progress=not args.quiet))
        else:
            print(inspect(args.load))
    except ConfigError as error:
        print(f"convert_checkpoint: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
