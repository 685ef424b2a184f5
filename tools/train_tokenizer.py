"""Train a SentencePiece tokenizer (BPE by default) on text files, directories or JSON-lines files.

    python tools/train_tokenizer.py --input corpus/ docs.jsonl --json-keys text --vocab-size 32000 \\
        --model-prefix tokenizers/mine          # writes tokenizers/mine.model and tokenizers/mine.vocab

Then use it with ``--tokenizer-model tokenizers/mine.model`` (preprocess_data.py, pretrain_gpt.py). What counts as a
document (and which lines are skipped) is described in megalite/data/documents.py; the model settings (exact round
trip of any text) in megalite/data/tokenizer.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from megalite.config.tool import check_writable, run_tool  # noqa: E402
from megalite.data.documents import iter_documents  # noqa: E402
from megalite.data.tokenizer import SentencePieceTokenizer, train_sentencepiece  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train_tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="Text files, directories (read recursively) or .jsonl files.")
    parser.add_argument("--model-prefix", required=True, help="Write PREFIX.model and PREFIX.vocab.")
    parser.add_argument("--vocab-size", type=int, default=32000, help="Number of pieces (default 32000).")
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram", "char", "word"],
                        help="SentencePiece algorithm (default bpe).")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="Keys of the JSON-lines records whose text is used (default text).")
    parser.add_argument("--whole-files", action="store_true",
                        help="A plain-text file is one document (source code), instead of one per line.")
    parser.add_argument("--character-coverage", type=float, default=0.9995,
                        help="Share of characters given their own piece; the rest become bytes (default 0.9995).")
    parser.add_argument("--input-sentence-size", type=int, default=0,
                        help="Train on at most this many lines, sampled from the input (default 0: all).")
    parser.add_argument("--num-threads", type=int, default=min(16, os.cpu_count() or 1),
                        help="Training threads (the model depends on it; default min(16, cores)).")
    parser.add_argument("--verbose", action="store_true", help="Show SentencePiece's own log.")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    return run_tool("train_tokenizer", lambda: train(args))


def train(args: argparse.Namespace) -> int:
    """The work; run_tool reports its errors."""
    start = time.perf_counter()
    check_writable(f"{os.fspath(args.model_prefix)}.model")   # before the training that would fill it
    documents = iter_documents(args.input, args.json_keys, args.whole_files)
    model = train_sentencepiece(documents, args.model_prefix, args.vocab_size, args.model_type,
                                args.character_coverage, args.input_sentence_size, args.num_threads, args.verbose)
    tokenizer = SentencePieceTokenizer(model)
    skipped = (f"; {documents.skipped_records} bad records skipped, each named above"
               if documents.skipped_records else "")
    print(f"wrote {model} ({tokenizer.vocab_size} pieces, EOD id {tokenizer.eod}) in "
          f"{time.perf_counter() - start:.1f} s{skipped}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
