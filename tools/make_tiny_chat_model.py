"""A tiny Llama-shaped chat model and a chat dataset, built locally (no download), for the README's fine-tuning
walk-through: ``chat.jsonl`` (2,000 "What is a plus b?" conversations) and ``tiny_hf/`` (a byte-level BPE of ~425
ids with a ChatML chat template, and a 2-layer Llama of 0.43M parameters with random weights) in the directory
given (default: the current one). Needs transformers and tokenizers (``pip install -e ".[hf]"``)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=".", help="where chat.jsonl and tiny_hf/ are written")
    out = Path(parser.parse_args().directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    records = []
    for _ in range(2000):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        records.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                     {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]})
    with open(out / "chat.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator([m["content"] for r in records for m in r["messages"]] + ["user assistant system"],
                            trainers.BpeTrainer(vocab_size=512, special_tokens=specials, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", chat_template=CHATML)
    tokenizer.save_pretrained(out / "tiny_hf")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(out / "tiny_hf")
    print(f"wrote {out / 'chat.jsonl'} and {out / 'tiny_hf'}")


if __name__ == "__main__":
    main()
