"""Continue a prompt with a trained checkpoint, using the tokenizer it was trained with.

    python tools/generate.py --load checkpoints/ --prompt "def main(" --max-new-tokens 64            # greedy
    python tools/generate.py --load checkpoints/ --prompt "import " --temperature 0.8 --top-k 50 --top-p 0.95

The checkpoint may have been saved at any layout (it is merged into one process, see megalite.load_pretrained).
The prompt runs once and each new token reuses the keys and values of the ones before (a KV cache;
``--no-kv-cache`` recomputes the whole context per token, giving the same tokens). Checkpoints trained on mock data
(or imported from a Hugging Face directory without a tokenizer) carry no tokenizer: the prompt is then token ids
separated by spaces, and so is the output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from megalite.checkpoint import load_pretrained  # noqa: E402
from megalite.config import ConfigError  # noqa: E402
from megalite.config.tool import run_tool  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, metavar="CKPT_DIR",
                        help="A checkpoint directory, or a --save directory (its latest checkpoint).")
    parser.add_argument("--prompt", required=True, help="The text to continue.")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="Tokens to generate at most (default 64).")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; above 0: sample from softmax(logits / temperature).")
    parser.add_argument("--top-k", type=int, default=0, help="Sample among the k most likely tokens (0: all).")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="Sample among the most likely tokens whose probability reaches p (1: all).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the sampling (default 0).")
    parser.add_argument("--no-kv-cache", action="store_true",
                        help="Rerun the model on the whole context for each new token (slower, same tokens).")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    return run_tool("generate", lambda: continue_prompt(args))


def continue_prompt(args: argparse.Namespace) -> int:
    """The work; run_tool reports its errors."""
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise ConfigError("need --max-new-tokens >= 0, --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1")
    model = load_pretrained(args.load)
    tokenizer = model.tokenizer()
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ConfigError("the prompt encodes to no tokens")
    new = model.generate(prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                         use_cache=not args.no_kv_cache)
    print(tokenizer.decode(new), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
