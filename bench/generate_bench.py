"""Time greedy generation per new token: megalite with its KV cache, megalite without it, and transformers' generate
(its own cache) on the same weights.

    python bench/generate_bench.py [--new-tokens 256] [--prompt 16] [--rounds 5] [--layers 4 --hidden 256 ...]

A random Hugging Face GPT-2 of the bench model's size is imported into megalite (the same weights both sides), then
each side generates ``--new-tokens`` tokens greedily from the same prompt, the sides taking turns round by round
(bench/common.py's ``alternate``). First it checks that the three produce the same tokens. Prints milliseconds per
new token and two ratios, medians of per-round ratios: no cache / cache (what the cache saves; it grows with the
number of new tokens, since without it token n reruns n + prompt positions) and megalite's cache / transformers'.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import add_model_arguments, alternate, load_average, paired_ratio, ratio_spread  # noqa: E402 - first
from megalite import load_pretrained  # noqa: E402 - common puts this checkout first on sys.path
from megalite.checkpoint.convert import import_hf  # noqa: E402


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    positions = args.prompt + args.new_tokens
    torch.manual_seed(args.seed)
    config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=positions, n_embd=args.hidden,
                                     n_layer=args.layers, n_head=args.heads, activation_function="gelu_new",
                                     bos_token_id=None, eos_token_id=None)   # no EOS: every side makes all tokens
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():   # larger weights than the initialization, so that greedy tokens vary with the context
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(Path(directory) / "hf")
        import_hf(Path(directory) / "hf", Path(directory) / "ckpt")
        model = load_pretrained(Path(directory) / "ckpt")
    prompt = torch.randint(args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()

    def hf_generate() -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        return out[0, len(prompt):].tolist()

    sides = {"megalite, KV cache": lambda: model.generate(prompt, args.new_tokens),
             "megalite, no cache": lambda: model.generate(prompt, args.new_tokens, use_cache=False),
             "transformers generate": hf_generate}
    tokens = {name: side() for name, side in sides.items()}
    if len({tuple(t) for t in tokens.values()}) != 1:
        raise SystemExit(f"the sides generate different tokens: {tokens}")
    print(f"GPT-2 {args.layers} x {args.hidden}, vocabulary {args.vocab}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens (the same on every side), {torch.get_num_threads()} threads, "
          f"load average {load_average():.1f}")
    times = alternate(sides, warmup=1, iters=args.rounds)
    for name, values in times.items():
        per_token = sorted(values)[len(values) // 2] / args.new_tokens
        print(f"  {name:<22} {per_token:8.2f} ms per new token (median of {len(values)} rounds)")
    cached, uncached, peer = (times[name] for name in sides)
    low, high = ratio_spread(uncached, cached)
    print(f"no cache / KV cache: {paired_ratio(uncached, cached):.2f} (IQR {low:.2f}-{high:.2f})")
    low, high = ratio_spread(cached, peer)
    print(f"megalite KV cache / transformers generate: {paired_ratio(cached, peer):.2f} (IQR {low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
