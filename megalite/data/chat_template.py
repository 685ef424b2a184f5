"""Conversations to tokens and a loss mask: which tokens the model is trained to produce (the assistant's).

A conversation is ``{"messages": [{"role": ..., "content": ...}, ...]}`` (roles system, user, assistant, tool) or a
``{"prompt": ..., "response": ...}`` pair (a user turn and an assistant turn). It is rendered by:

- the tokenizer's own chat template, when its Hugging Face directory has one (``chat_template`` in
  tokenizer_config.json, or chat_template.jinja): through transformers' ``apply_chat_template``, so the tokens are
  exactly transformers'. An assistant turn's tokens are those between the rendering of the conversation before it
  (with the generation prompt, e.g. ``<|im_start|>assistant\\n``) and the rendering up to and including it (so its
  end-of-turn marker is trained too); a template that does not render a conversation's beginnings as prefixes of
  it (one that rewrites earlier turns) is refused, since no token could then be said to be the assistant's;
- otherwise the ``plain`` format: each turn is ``Role: content`` and a blank line (``User: hi\\n\\n``), the
  assistant's content and its blank line trained, each piece encoded on its own.

The end-of-document token closes each conversation (trained when the assistant has the last turn: the model learns
to stop). Packed documents find conversations by it, so a template that puts it inside a conversation is refused
when packing (megalite.data.sft).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megalite.data.errors import DataError
from megalite.data.tokenizer import HF_CHAT_TEMPLATE, HF_TOKENIZER_CONFIG, HuggingFaceTokenizer, Tokenizer

ROLES = ("system", "user", "assistant", "tool")


def conversation_messages(record: Any, where: str) -> list[dict[str, str]]:
    """The messages of one record (``messages`` or a ``prompt``/``response`` pair), checked: DataError naming
    ``where`` (file and line) on anything else, an unknown role, a non-text content, an empty assistant turn, or no
    assistant turn at all."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a conversation is a JSON object with \"messages\" (or \"prompt\" and "
                        f"\"response\"), not {type(record).__name__}")
    record = {key: value for key, value in record.items() if value is not None}   # a table's missing columns
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "response" in record:
        messages = [{"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["response"]}]
    else:
        raise DataError(f"{where}: no \"messages\" (nor \"prompt\" and \"response\") in the record (keys: "
                        f"{', '.join(sorted(map(str, record))) or 'none'})")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    checked = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: message {n} is not a {{\"role\", \"content\"}} object")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise DataError(f"{where}: message {n} has the unknown role {role!r} (known: {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {n}'s content is {type(content).__name__}, not text")
        if role == "assistant" and not content.strip():
            raise DataError(f"{where}: message {n} is an empty assistant turn (nothing to learn from)")
        checked.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in checked):
        raise DataError(f"{where}: the conversation has no assistant turn (nothing to learn from)")
    return checked


@dataclass
class RenderedConversation:
    tokens: np.ndarray   # int64, ending with the end-of-document token
    mask: np.ndarray     # uint8, 1 where the token is one the model is trained to produce


class ChatRenderer:
    """Renders conversations with one tokenizer: its chat template, or the plain format (``name`` says which)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.eod = tokenizer, tokenizer.eod
        self._hf = _transformers_tokenizer(tokenizer) if isinstance(tokenizer, HuggingFaceTokenizer) else None
        self.name = "the tokenizer's chat template" if self._hf is not None else "the plain format"

    def render(self, messages: list[dict[str, str]], where: str) -> RenderedConversation:
        tokens, mask = self._templated(messages, where) if self._hf is not None else self._plain(messages)
        ends_with_assistant = messages[-1]["role"] == "assistant"
        if not tokens or tokens[-1] != self.eod:
            tokens, mask = tokens + [self.eod], mask + [int(ends_with_assistant)]
        return RenderedConversation(np.asarray(tokens, dtype=np.int64), np.asarray(mask, dtype=np.uint8))

    def _plain(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        tokens: list[int] = []
        mask: list[int] = []
        for message in messages:
            head = self.tokenizer.encode(f"{message['role'].capitalize()}: ")
            body = self.tokenizer.encode(f"{message['content']}\n\n")
            tokens += head + body
            mask += [0] * len(head) + [int(message["role"] == "assistant")] * len(body)
        return tokens, mask

    def _templated(self, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
        def text(upto: int, generation_prompt: bool) -> str:
            return self._hf.apply_chat_template(messages[:upto], tokenize=False,
                                                add_generation_prompt=generation_prompt)

        whole = text(len(messages), False)
        spans = []   # [start, end) characters of each assistant turn in ``whole``
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = text(i, True), text(i + 1, False)
            if not (through.startswith(before) and whole.startswith(through)):
                raise DataError(f"{where}: the chat template does not render the conversation before turn {i} as "
                                f"the beginning of the whole (it rewrites earlier turns): its assistant tokens "
                                f"cannot be told apart")
            spans.append((len(before), len(through)))
        encoded = self._hf(whole, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(start <= first < end for start, end in spans)) for first, _ in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), mask


def has_chat_template(files: dict[str, bytes]) -> bool:
    if HF_CHAT_TEMPLATE in files:
        return True
    config = json.loads(files[HF_TOKENIZER_CONFIG]) if HF_TOKENIZER_CONFIG in files else {}
    return bool(config.get("chat_template"))


def _transformers_tokenizer(tokenizer: HuggingFaceTokenizer):
    """transformers' tokenizer of the same files, when they hold a chat template (else None: the plain format)."""
    files = tokenizer.files()
    if not has_chat_template(files):
        return None
    from transformers import PreTrainedTokenizerFast   # noqa: PLC0415 - only for a tokenizer with a template

    with tempfile.TemporaryDirectory() as folder:
        for name, contents in files.items():
            Path(folder, name).write_bytes(contents)
        return PreTrainedTokenizerFast.from_pretrained(os.fspath(folder))
