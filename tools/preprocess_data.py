"""Tokenize text into an indexed dataset: PREFIX.bin (the tokens) and PREFIX.idx (where each document is).

    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/mine \\
        --tokenizer-model tokenizers/mine.model --workers 4 --append-eod

Then train with ``--data-path data/mine --tokenizer-model tokenizers/mine.model``. A Hugging Face tokenizer:
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` (DIR holds tokenizer.json, e.g. a model's folder);
GPT-2's BPE: ``--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt``. Inputs and
documents are as for train_tokenizer.py (megalite/data/documents.py: a bad JSON record is skipped with a warning
naming its file and line, and counted in the summary, or stops the tool with one line where the options are wrong);
the file format is in megalite/data/indexed_dataset.py.

Conversations for supervised fine-tuning (``--sft``; megalite/data/sft.py): each input a JSONL, Parquet or Arrow
file or a datasets directory of ``{"messages": [...]}`` or ``{"prompt", "response"}`` records, rendered with the
tokenizer's chat template (else the plain format) into PREFIX.bin/.idx and the loss mask into
PREFIX_loss_mask.bin/.idx; then train with ``--sft --data-path PREFIX``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from megalite.config import TOKENIZER_TYPES  # noqa: E402
from megalite.config.tool import check_writable, run_tool  # noqa: E402
from megalite.data.documents import iter_documents  # noqa: E402
from megalite.data.preprocess import preprocess  # noqa: E402
from megalite.data.sft import LOSS_MASK_SUFFIX, write_preprocessed  # noqa: E402
from megalite.data.tokenizer import build_tokenizer  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="preprocess_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="Text files, directories (read recursively) or .jsonl files.")
    parser.add_argument("--output-prefix", required=True, help="Write PREFIX.bin and PREFIX.idx.")
    parser.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", help="SentencePiece or tiktoken model file, or a Hugging Face tokenizer's "
                                                  "directory.")
    parser.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json.")
    parser.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt.")
    parser.add_argument("--vocab-size", type=int, default=0, help="Vocabulary of the NullTokenizer.")
    parser.add_argument("--tiktoken-pattern", choices=("v1", "v2"), help="TikTokenizer's pre-tokenization pattern.")
    parser.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                        help="TikTokenizer's ids reserved for special tokens (default 1000).")
    parser.add_argument("--tiktoken-special-tokens", nargs="+", metavar="TOKEN",
                        help="TikTokenizer's special tokens in id order (default <unk> <s> </s>).")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="Keys of the JSON-lines records to tokenize, each one document (default text).")
    parser.add_argument("--whole-files", action="store_true",
                        help="A plain-text file is one document (source code), instead of one per line.")
    parser.add_argument("--workers", type=int, default=1, help="Tokenizing processes (default 1).")
    parser.add_argument("--append-eod", action="store_true", help="Append the end-of-document id to each document.")
    parser.add_argument("--sft", action="store_true",
                        help="Conversations (JSONL/Parquet/Arrow/datasets directory) with their loss mask, for --sft.")
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    return run_tool("preprocess_data", lambda: tokenize(args))


def tokenize(args: argparse.Namespace) -> int:
    """The work; run_tool reports its errors."""
    check_writable(f"{os.fspath(args.output_prefix)}.bin")   # before the tokenizing that would fill it
    check_writable(f"{os.fspath(args.output_prefix)}.idx")
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                                vocab_file=args.vocab_file, merge_file=args.merge_file,
                                tiktoken_pattern=args.tiktoken_pattern,
                                tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                                tiktoken_special_tokens=" ".join(args.tiktoken_special_tokens or []) or None)
    if args.sft:
        start = time.perf_counter()
        conversations, tokens, trained = write_preprocessed(args.input, tokenizer, os.fspath(args.output_prefix))
        print(f"wrote {os.fspath(args.output_prefix)}.bin/.idx and {LOSS_MASK_SUFFIX} .bin/.idx: {conversations:,} "
              f"conversations, {tokens:,} tokens ({trained:,} trained) in {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
        return 0
    documents = iter_documents(args.input, args.json_keys, args.whole_files)
    stats = preprocess(documents, tokenizer, args.output_prefix, args.workers, args.append_eod,
                       progress=None if args.quiet else sys.stderr)
    skipped = [f"{stats.skipped} empty ones skipped"] if stats.skipped else []
    if documents.skipped_records:
        skipped.append(f"{documents.skipped_records} bad records skipped, each named above")
    print(f"wrote {os.fspath(args.output_prefix)}.bin/.idx: {stats.documents:,} documents, {stats.tokens:,} tokens"
          + (f" ({'; '.join(skipped)})" if skipped else "")
          + f" in {stats.seconds:.1f} s ({stats.tokens / max(stats.seconds, 1e-9):,.0f} tokens/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
