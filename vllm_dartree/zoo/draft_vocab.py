"""A reduced draft vocabulary: the N target tokens a drafter scores (EAGLE-3's draft
vocabulary and FR-Spec's frequency-ranked subset have the idea; this is our version).

The drafter's lm-head is most of a small drafter's cost (SmolLM2: 49,152 x 576 of a
one-layer drafter), in training and in serving. Scoring only the N most frequent tokens of
the target's own responses keeps almost every token the drafter could have proposed, and a
token outside the N is simply never proposed: the target still verifies every node, so
output stays exactly the target's.

    select_draft_vocab(sequences, size)  -> [N] strictly increasing target ids
    coverage(sequences, ids)             -> share of response tokens inside them

`sequences` are (tokens, first_response_position) pairs: only response tokens are counted,
which is where the drafter drafts (prompt tokens are never drafted).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["count_response_tokens", "select_draft_vocab", "coverage"]


def count_response_tokens(sequences: Iterable[tuple[torch.Tensor, int]],
                          vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each target id occurs in the sequences' responses."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens, start in sequences:
        counts += torch.bincount(tokens[start:].long(), minlength=vocab_size)[:vocab_size]
    return counts


def select_draft_vocab(sequences: Iterable[tuple[torch.Tensor, int]], size: int,
                       vocab_size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent response tokens (ties: lower id first), plus the ids in
    `always` (e.g. EOS), as [N] int64 sorted ascending (N = size)."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in [1, {vocab_size}]")
    counts = count_response_tokens(sequences, vocab_size)
    forced = sorted(set(int(t) for t in always))
    if len(forced) > size:
        raise ValueError(f"{len(forced)} forced tokens do not fit a vocabulary of {size}")
    key = counts.double()
    key[forced] = float("inf")
    # a stable descending sort: equal counts keep ascending ids
    order = torch.sort(-key, stable=True).indices
    return order[:size].sort().values


def coverage(sequences: Iterable[tuple[torch.Tensor, int]], ids: torch.Tensor) -> float:
    """Share of the sequences' response tokens that lie inside the draft vocabulary."""
    inside = total = 0
    for tokens, start in sequences:
        resp = tokens[start:].long()
        inside += int(torch.isin(resp, ids).sum())
        total += resp.numel()
    return inside / max(1, total)
