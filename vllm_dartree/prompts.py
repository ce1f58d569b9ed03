"""Prompts as token ids: one user turn through the tokenizer's chat template, and JSONL
prompt files. Shared by the engine's generator, the reference decoder, the benchmarks and the
data pipeline (a neutral module: `engine/` and `reference/` do not import `bench/`)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["PromptFileError", "chat_prompt_ids", "read_prompt_ids"]


class PromptFileError(ValueError):
    """A prompt file line that is not {"prompt": text} (the message names file and line)."""


def chat_prompt_ids(tokenizer, text: str, use_template: bool = True) -> list[int]:
    """One user turn -> token ids, with the tokenizer's chat template (thinking off where the
    template has the switch) when it has one."""
    if not (use_template and tokenizer.chat_template):
        return list(tokenizer(text)["input_ids"])
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    return list(tokenizer(chat, add_special_tokens=False)["input_ids"])


def read_prompt_ids(path: str | Path, tokenizer, use_template: bool = True,
                    limit: int | None = None) -> tuple[list[str], list[list[int]]]:
    """A JSONL file of {"prompt": text} lines -> (texts, token ids), the first `limit`;
    raises PromptFileError on a line that is not such an object."""
    texts: list[str] = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            texts.append(json.loads(line)["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise PromptFileError(f"{path}:{line_no}: expected a JSON object with a "
                                  "'prompt' field") from None
        if limit and len(texts) >= limit:
            break
    return texts, [chat_prompt_ids(tokenizer, t, use_template) for t in texts]
