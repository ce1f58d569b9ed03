"""DSpark's vanilla Markov head (deepseek-ai/DeepSpec; research/drafters.md, section 3).

A first-order previous-token bias added to the backbone's base logits:

    logits_d = base_d + markov_w2 . markov_w1[prev]      (prev = the root at depth 1)

`markov_w1` is an embedding [V, r], `markov_w2` a bias-free linear r -> V (weight [V, r]).
Implements the correction-head contract of `vllm_dartree.tree.heads`; the state is the
previous token id, so `score` is a [P, r] x [r, K] product over the candidate rows only.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MarkovHead"]


class MarkovHead(nn.Module):
    num_uncorrected = 0   # the bias applies from depth 1 (prev = root)

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] -> the full-vocabulary bias [..., V] (training and tests)."""
        return self.markov_w2(self.markov_w1(prev))

    def init(self, root_tokens: torch.Tensor) -> torch.Tensor:
        return root_tokens[:, None].clone()                          # [R, 1]

    def prepare(self, hidden: torch.Tensor | None, candidate_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w2.weight[candidate_ids]                   # [R, D, K, r]

    def score(self, prepared: torch.Tensor, depth: int, state: torch.Tensor) -> torch.Tensor:
        prev = self.markov_w1(state)                                  # [R, P, r]
        return torch.bmm(prev, prepared[:, depth].transpose(1, 2).to(prev.dtype))

    def advance(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.clone()
