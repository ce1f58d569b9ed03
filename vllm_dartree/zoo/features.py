"""Training sequences with the target's features (`FeatureShard`) and the shard files
`zoo.data` writes (`load_shards`): the one module both the data pipeline and the trainer
read, so that neither imports the other."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["SOURCES", "FeatureShard", "load_shards"]

# the prompt sources of `zoo.data`, in the order training reads their shards (ShareGPT first:
# the held-out sequences come from it); SOURCE-features-*.pt for all but the first
SOURCES = ("sharegpt", "code", "math", "solve")


@dataclass
class FeatureShard:
    tokens: torch.Tensor     # [T] int64
    features: torch.Tensor   # [T, n*H] the target's features of every token
    first_anchor: int = 0    # the prompt length: anchors (block roots) are response tokens

    def anchor_range(self) -> tuple[int, int]:
        """[lo, hi) of the anchors whose block has at least one label (as SpecForge's loss
        mask: the drafter never drafts inside the prompt, so it is not trained there)."""
        hi = max(1, self.tokens.shape[0] - 1)
        return min(self.first_anchor, hi - 1), hi



def load_shards(paths: list[Path], responses: Path | None = None) -> list[FeatureShard]:
    """The shards' sequences (features stay bf16 and on disk until a step reads them; the
    drafter converts them); prompt lengths from the shards, or for shards written before
    they were stored, from `responses` (the responses.jsonl the shards were made from)."""
    rows = ([json.loads(line) for line in open(responses) if line.strip()]
            if responses is not None and responses.exists() else None)
    out = []
    for path in paths:   # memory-mapped: 9,500 sequences of features exceed the RAM
        for item in torch.load(path, mmap=True):
            prompt_len = item.get("prompt_len")
            if prompt_len is None and rows is not None:
                row = rows[len(out)]
                if len(row["prompt_ids"]) + len(row["output_ids"]) != item["tokens"].shape[0]:
                    raise ValueError(f"{path}: sequence {len(out)} does not match {responses}")
                prompt_len = len(row["prompt_ids"])
            out.append(FeatureShard(item["tokens"], item["features"], prompt_len or 0))
    return out
