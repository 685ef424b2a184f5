"""--sft: conversations rendered with the tokenizer's chat template (equal to transformers'), the loss on the
assistant's tokens only, packed or padded samples, every source kind, and bad input refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megalite.config import ConfigError
from megalite.config.validate import validate
from megalite.data import DataError, build_datasets, check_data_files
from megalite.data.chat_template import ChatRenderer, conversation_messages
from megalite.data.tokenizer import HuggingFaceTokenizer
from megalite.training import Trainer

from ..helpers import single_layout, tiny_config
from .helpers import build_chat_tokenizer, chat_records
from .test_tokenizer_and_preprocess import load_tool

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sft_config(data_path, tokenizer_dir, seq_length=64, **data):
    return tiny_config(model={"seq_length": seq_length},
                       data={"mock_data": False, "sft": True, "data_path": str(data_path), "split": "90,10,0",
                             "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tokenizer_dir), **data},
                       training={"train_iters": 1, "global_batch_size": 4})


def test_the_chat_template_renders_as_transformers_does(chat_dir):
    reference = transformers.AutoTokenizer.from_pretrained(str(chat_dir))
    renderer = ChatRenderer(HuggingFaceTokenizer.from_directory(chat_dir))
    assert renderer.name == "the tokenizer's chat template"
    for n, record in enumerate(chat_records(12)):
        messages = conversation_messages(record, f"record {n}")
        rendered = renderer.render(messages, f"record {n}")
        expected = reference.apply_chat_template(messages, tokenize=True)["input_ids"]
        assert rendered.tokens.tolist() == list(expected) + [renderer.eod]
        # The trained tokens are each assistant turn and its end-of-turn marker, and the EOD that ends the
        # conversation (its last turn is the assistant's).
        trained = reference.decode(rendered.tokens[rendered.mask == 1])
        assert trained == "".join(f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant") + \
            "<|endoftext|>"


def test_a_template_saved_by_transformers_is_read(chat_dir, tmp_path):
    """transformers 5 saves the template as chat_template.jinja, not in tokenizer_config.json (import-hf keeps it)."""
    transformers.AutoTokenizer.from_pretrained(str(chat_dir)).save_pretrained(str(tmp_path))
    assert (tmp_path / "chat_template.jinja").is_file()
    assert ChatRenderer(HuggingFaceTokenizer.from_directory(tmp_path)).name == "the tokenizer's chat template"


def test_the_plain_format_without_a_template(corpus):
    renderer = ChatRenderer(corpus.tokenizer)
    assert renderer.name == "the plain format"
    messages = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "jumps over"}]
    rendered = renderer.render(messages, "here")
    assert corpus.tokenizer.decode(rendered.tokens[rendered.mask == 1][:-1]).strip() == "jumps over"
    assert rendered.tokens[-1] == corpus.tokenizer.eod and rendered.mask[-1] == 1


@pytest.mark.parametrize("record, seq_length, words", [
    ({"text": "hello"}, 64, 'no "messages"'),
    ({"messages": [{"role": "robot", "content": "x"}]}, 64, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}, 64,
     "empty assistant turn"),
    ({"prompt": "the quick brown fox " * 20, "response": "jumps"}, 64, "more than a sample's --seq-length 64"),
])
def test_bad_conversations_stop_the_run_in_one_line(tmp_path, chat_dir, record, seq_length, words):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(3) + [record])
    with pytest.raises(DataError, match=f"^{tmp_path}/chat.jsonl:4: .*{words}") as error:
        check_data_files(sft_config(path, chat_dir, seq_length))
    assert "\n" not in str(error.value)


def test_sft_needs_its_data(tmp_path, chat_dir):
    cfg = sft_config(tmp_path / "chat.jsonl", chat_dir)
    with pytest.raises(ConfigError, match="--sft needs --data-path"):
        validate(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data_path=None)), world_size=1)


def _items(dataset) -> list[torch.Tensor]:
    return [dataset[i] for i in range(len(dataset))]


def test_samples_pack_whole_conversations_or_pad_one(tmp_path, chat_dir):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(40))
    eod = HuggingFaceTokenizer.from_directory(chat_dir).eod
    for packed in (False, True):
        cfg = sft_config(path, chat_dir, reset_attention_mask=packed, reset_position_ids=packed)
        data = build_datasets(cfg, (30, 4, 0))
        assert data.test is None and len(data.valid) == 4
        items = _items(data.train)
        assert all(item.shape == (2, 65) for item in items)
        conversations = [int((item[0] == eod).sum() - (item[0][item[1] == 0] == eod).sum()) for item in items]
        for item in items:
            tokens, mask = item
            last = int((tokens != eod).nonzero().max())   # padding after the last conversation is outside the loss
            assert not mask[last + 2:].any() and mask.any()
        if packed:
            assert max(conversations) > 1
        else:   # one conversation, its EOD trained, then padding
            assert conversations == [1] * len(items)
        assert all(torch.equal(a, b) for a, b in zip(items, _items(build_datasets(cfg, (30, 4, 0)).train)))


def test_every_source_kind_gives_the_same_samples(tmp_path, chat_dir):
    records = chat_records(20)
    jsonl = write_jsonl(tmp_path / "chat.jsonl", records)
    expected = _items(build_datasets(sft_config(jsonl, chat_dir), (8, 0, 0)).train)
    datasets = pytest.importorskip("datasets")
    # Columns: a record's missing keys are nulls there (from_list takes the first row's keys).
    table = datasets.Dataset.from_list([{key: r.get(key) for key in ("messages", "prompt", "response")}
                                        for r in records])
    table.to_parquet(str(tmp_path / "chat.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    assert load_tool("preprocess_data").main(["--sft", "--input", str(jsonl), "--output-prefix", str(tmp_path / "pre"),
                                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(chat_dir),
                                 "--quiet"]) == 0
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for source in (tmp_path / "chat.parquet", tmp_path / "saved", arrow, tmp_path / "pre"):
        got = _items(build_datasets(sft_config(source, chat_dir), (8, 0, 0)).train)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), source


def _first_step(path: Path, chat_dir: Path) -> dict:
    cfg = sft_config(path, chat_dir, 96, eval_interval=0)
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, micro_batch_size=4))
    with single_layout():
        trainer = Trainer.on_registered_layout(cfg, torch.device("cpu"))
        record = trainer.train_step()
        record["trained_tokens"] = sum(int(trainer.data.train[i][1, 1:].sum()) for i in range(4))
    return record


def test_prompt_tokens_change_the_loss_only_through_conditioning(tmp_path, chat_dir):
    """Conversations ending with a user turn: no assistant token comes after it, so it can change the loss only by
    its own positions' predictions, which the mask leaves out: the loss and gradients stay equal to the last bit.
    A user turn before an assistant's changes the loss (the assistant's tokens are conditioned on it)."""
    records = [{"messages": r["messages"] if "messages" in r else [{"role": "user", "content": r["prompt"]},
                                                                   {"role": "assistant", "content": r["response"]}]}
               for r in chat_records(4, seed=3)]

    def ending_with(text: str, before: str = "") -> Path:
        path = tmp_path / f"chat-{len(list(tmp_path.iterdir()))}.jsonl"
        changed = [{"messages": [{**m, "content": before + m["content"]} if m["role"] == "user" else m
                                 for m in r["messages"]] + [{"role": "user", "content": text}]} for r in records]
        return write_jsonl(path, changed * 10)

    base = _first_step(ending_with("thanks a lot"), chat_dir)
    trailing = _first_step(ending_with("no that was wrong, try again please"), chat_dir)
    assert (trailing["loss"], trailing["grad_norm"]) == (base["loss"], base["grad_norm"])
    conditioned = _first_step(ending_with("thanks a lot", before="quick "), chat_dir)
    assert conditioned["loss"] != base["loss"]
    assert conditioned["loss_tokens"] == base["loss_tokens"] == base["trained_tokens"] < 4 * 96


def test_the_walk_through_s_tiny_chat_model_renders_its_data(tmp_path, monkeypatch):
    """tools/make_tiny_chat_model.py (the README's fine-tuning walk-through) writes conversations and a model whose
    tokenizer renders them with its template as transformers does."""
    monkeypatch.setattr("sys.argv", ["make_tiny_chat_model.py", str(tmp_path)])
    load_tool("make_tiny_chat_model").main()
    config = json.loads((tmp_path / "tiny_hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["architectures"] == ["LlamaForCausalLM"]
    record = json.loads((tmp_path / "chat.jsonl").read_text().splitlines()[0])
    renderer = ChatRenderer(HuggingFaceTokenizer.from_directory(tmp_path / "tiny_hf"))
    expected = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tiny_hf")).apply_chat_template(
        record["messages"], tokenize=True)["input_ids"]
    assert renderer.render(record["messages"], "record 0").tokens.tolist() == list(expected) + [renderer.eod]
