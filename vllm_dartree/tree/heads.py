"""The correction-head contract between drafters and tree builders (drafters.md, section 4).

One backbone pass gives, per request r and draft depth d, a hidden state z[r, d] and base
logits. A correction head then scores candidate tokens for any number P of path prefixes
per request, given a per-prefix state:

    state   = head.init(root_tokens)                      # [R] -> [R, 1, *S]
    prep    = head.prepare(hidden, candidate_ids)         # once per round
    delta   = head.score(prep, d, state)                  # [R, P, *S] -> [R, P, K]
    state'  = head.advance(state, tokens)                 # [R, P] tokens -> [R, P, *S]

`score` returns the correction added to the base logits of the K candidates of depth d
only (never a full [P, V] product). Depths d < `num_uncorrected` are scored from the base
logits alone, normalised over the full vocabulary (Domino: pure_draft_prefix_len = 1).

This module also holds `NoHead` (DFlash: the backbone's marginals) and `MarkovToyHead`, a
small first-order head for tests and demos. The real Domino GRU and DSpark Markov heads
live in `vllm_dartree.drafter`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["CorrectionHead", "NoHead", "MarkovToyHead", "gather_prefixes"]


@runtime_checkable
class CorrectionHead(Protocol):
    num_uncorrected: int  # leading depths scored by the base logits alone

    def init(self, root_tokens: torch.Tensor) -> torch.Tensor: ...

    def prepare(self, hidden: torch.Tensor, candidate_ids: torch.Tensor) -> Any: ...

    def score(self, prepared: Any, depth: int, state: torch.Tensor) -> torch.Tensor: ...

    def advance(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor: ...


def gather_prefixes(state: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """state [R, P, *S], index [R, Q] -> [R, Q, *S]: the states of the chosen prefixes."""
    idx = index.reshape(*index.shape, *([1] * (state.dim() - 2)))
    return torch.gather(state, 1, idx.expand(*index.shape, *state.shape[2:]))


class NoHead:
    """No correction: every depth uses the backbone's marginals (DFlash, DDTree)."""

    num_uncorrected = 1 << 30

    def init(self, root_tokens: torch.Tensor) -> torch.Tensor:
        return root_tokens.new_zeros(root_tokens.shape[0], 1, 0, dtype=torch.float32)

    def prepare(self, hidden: torch.Tensor | None, candidate_ids: torch.Tensor) -> None:
        return None

    def score(self, prepared: None, depth: int, state: torch.Tensor) -> torch.Tensor:
        raise AssertionError("NoHead is never asked to score: all depths are uncorrected")

    def advance(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return state.new_zeros(*tokens.shape, 0)


class MarkovToyHead:
    """A first-order head for tests: correction = table[d, previous token, candidate].

    The state is the previous token along the path ([R, P] int64), so scores are
    path-dependent and exact answers are easy to enumerate by brute force.
    """

    def __init__(self, table: torch.Tensor, num_uncorrected: int = 1):
        self.table = table  # [D, V, V] float, correction for (depth, previous, candidate)
        self.num_uncorrected = num_uncorrected

    def init(self, root_tokens: torch.Tensor) -> torch.Tensor:
        return root_tokens[:, None].clone()

    def prepare(self, hidden: torch.Tensor | None, candidate_ids: torch.Tensor) -> torch.Tensor:
        return candidate_ids  # [R, D, K]

    def score(self, prepared: torch.Tensor, depth: int, state: torch.Tensor) -> torch.Tensor:
        cand = prepared[:, depth]                                   # [R, K]
        rows = self.table[depth][state]                             # [R, P, V]
        return torch.gather(rows, 2, cand[:, None, :].expand(-1, state.shape[1], -1))

    def advance(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.clone()
