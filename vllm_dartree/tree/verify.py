"""Tree verification walks, batched over requests, with no host synchronisation.

The target scores `[root] + nodes` in one pass; its token at every column (argmax, or a
sample) is compared with the draft. Accept rule (DDTree, section 1 of tree-algorithms.md):

    start at the root; while the target's token at the current node is one of its
    children's tokens, move to that child; emit the path and the target's token at the
    last node (the bonus).

Batched form: node i is accepted iff every node j on its root path (itself included)
carries the target's token at j's parent. Siblings are distinct, so the accepted nodes form
one path. At T > 0 the target token at every node is a sample of the target under that
node's true context, so every emitted token is a target sample: the walk is lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_dartree import ops
from vllm_dartree.tree.structure import TreeBatch, valid_node_mask

__all__ = ["WalkResult", "walk", "greedy_walk", "sampled_walk", "sample_target_tokens"]


@dataclass(frozen=True, slots=True)
class WalkResult:
    accepted_nodes: torch.Tensor  # [R, N] int64, accepted node indices by depth, -1 padded
    num_accepted: torch.Tensor    # [R] int64, L = accepted draft nodes (the bonus excluded)
    bonus_tokens: torch.Tensor    # [R] int64, the target's token at the last accepted node

    def output_tokens(self, tree: TreeBatch) -> torch.Tensor:
        """[R, 1 + N] int64: accepted draft tokens, then the bonus, then -1 padding."""
        num_req, n = self.accepted_nodes.shape
        drafted = torch.gather(tree.tokens, 1, self.accepted_nodes.clamp(min=0))
        out = torch.cat([drafted, drafted.new_full((num_req, 1), -1)], dim=1)
        cols = torch.arange(1 + n, device=out.device)
        out = torch.where(cols[None, :] < self.num_accepted[:, None], out, -1)
        return out.scatter(1, self.num_accepted[:, None], self.bonus_tokens[:, None])


def walk(tree: TreeBatch, target_tokens: torch.Tensor,
         mask: torch.Tensor | None = None) -> WalkResult:
    """Accept the longest root path whose drafts equal the target's tokens.

    target_tokens: [R, 1 + N] int64, the target's token at the root and at every node.
    mask: the [R, 1 + N, 1 + N] ancestor mask if the caller has it; without one, whether
    every node of a root path matches is found by pointer jumping (log2 N rounds of two
    gathers; the mask costs N rounds of a gather and an [R, 1 + N, 1 + N] scatter).
    """
    num_req, n = tree.tokens.shape
    if n == 0:   # no draft slots at all: plain decoding, the bonus is the root's token
        empty = tree.tokens.new_empty(num_req, 0)
        return WalkResult(empty, tree.num_nodes.new_zeros(num_req), target_tokens[:, 0])
    at_parent = torch.gather(target_tokens, 1, tree.parents + 1)          # [R, N]
    match = (tree.tokens == at_parent) & valid_node_mask(tree)            # [R, N]
    if mask is not None:
        on_path = mask[:, 1:, 1:]                                         # [R, N, N]
        accepted = ~(on_path & ~match[:, None, :]).any(dim=-1) & match    # [R, N]
    else:
        accepted = _path_matches(tree.parents, match)
    num_accepted = accepted.sum(dim=1)
    # accepted nodes have distinct depths 1..L: put each at column depth - 1 (others: dump)
    slot = torch.where(accepted, tree.depths - 1, n)
    path = tree.tokens.new_full((num_req, n + 1), -1)
    path.scatter_(1, slot, torch.arange(n, device=slot.device).expand(num_req, -1))
    path = path[:, :n]
    cols = torch.arange(n, device=path.device)
    path = torch.where(cols[None, :] < num_accepted[:, None], path, -1)
    last = torch.gather(path, 1, (num_accepted - 1).clamp(min=0)[:, None])[:, 0]
    last = torch.where(num_accepted > 0, last, -1)                        # -1 = the root
    bonus = torch.gather(target_tokens, 1, (last + 1)[:, None])[:, 0]
    return WalkResult(path, num_accepted, bonus)


def _path_matches(parents: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
    """[R, N] bool: node i and all its ancestors match. Over the columns [root] + nodes
    (the root matches and is its own parent), `ok[c]` holds for c and the `span` - 1 nodes
    above it and `up[c]` is the node `span` hops up; each round doubles `span`, and a node at
    depth d is settled once span >= d (depths are at most N)."""
    num_req, n = match.shape
    ok = torch.cat([match.new_ones(num_req, 1), match], dim=1)            # [R, 1 + N]
    up = torch.cat([parents.new_zeros(num_req, 1), parents + 1], dim=1)   # [R, 1 + N]
    span = 1
    while span < n:
        ok = ok & torch.gather(ok, 1, up)
        up = torch.gather(up, 1, up)
        span *= 2
    return ok[:, 1:]


def greedy_walk(tree: TreeBatch, target_logits: torch.Tensor,
                mask: torch.Tensor | None = None) -> WalkResult:
    """Temperature 0: target_logits [R, 1 + N, V] -> argmax at every column, then walk."""
    return walk(tree, ops.argmax(target_logits), mask)


def sampled_walk(
    tree: TreeBatch,
    target_logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    mask: torch.Tensor | None = None,
) -> WalkResult:
    """Sample the target at every node with each request's settings, then walk."""
    tokens = sample_target_tokens(target_logits, temperature, top_k, top_p, generators)
    return walk(tree, tokens, mask)


def sample_target_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """One target sample per column: logits [R, T, V] -> [R, T] int64.

    temperature [R] float (0 = greedy for that request), top_k [R] int64 (0 or >= V: off),
    top_p [R] float (1.0: off). Sampling is argmax(probs / E) with E ~ Exp(1) i.i.d., which
    draws exactly from probs without a host sync. `generators[r]` seeds request r's noise;
    requests with None (or no list at all) use the global generator; `noise` [R, T, V]
    (i.i.d. Exp(1)) replaces the draws altogether (position-keyed noise, see the runner).
    """
    greedy = ops.argmax(logits)
    scaled = logits.float() / temperature.clamp(min=1e-6).float()[:, None, None]
    if top_k is not None or top_p is not None:
        scaled = _top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    if noise is None:
        noise = _exponential_noise(probs, generators)
    sampled = ops.argmax(probs / noise)
    return torch.where(temperature[:, None] > 0, sampled, greedy)


def _exponential_noise(like: torch.Tensor,
                       generators: Sequence[torch.Generator | None] | None) -> torch.Tensor:
    noise = torch.empty_like(like)
    if generators is None:
        return noise.exponential_()
    # NOTE: per-request seeds need one draw per seeded request (as vLLM's sampler does);
    # this launches R small kernels but never synchronises.
    for r, gen in enumerate(generators):
        noise[r].exponential_(generator=gen)
    return noise


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits [R, T, V] outside each request's top-k and top-p nucleus with -inf."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
        ranks = torch.arange(vocab, device=logits.device)
        drop |= ranks[None, None, :] >= k[:, None, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs    # keep the token that crosses p
        p = top_p.float()[:, None, None]
        drop |= (mass_before >= p) & (p < 1.0)              # p >= 1: off, even after rounding
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
