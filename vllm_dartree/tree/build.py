"""Batched tree builders: DARTree (pruned, fixed), DDTree top-B, and the greedy chain.

All of them are one depth-synchronous loop (`grow`), batched over R requests with static
shapes and no host synchronisation; they differ only in the per-depth quota, in whether the
correction head is used, and in the final selection (DARTree paper, Algorithm 1):

1. Candidates per depth d: top-K of the base logits, shared by every parent at that depth.
2. Depths d < head.num_uncorrected: log q = logit - logsumexp(full vocabulary).
   Later depths: the head's corrected logits of the K candidates, renormalised over K.
3. path score = parent score + log q; keep the global top-quota children per request
   (pruned: W per depth; fixed: ceil(remaining / remaining depths), B in total).
4. Advance the head's state for the kept children only.
5. Pruned: global top-B of `score + beta * depth` over the whole supertree (Lemma 1: with
   beta <= 0 and ties to ancestors this equals best-first search); re-sort the kept nodes
   into topological order and remap their parents.

DDTree (Ringel & Romano) is the same loop with no head, K = min(B, V), quota B per depth and
beta = 0: a node of the global top-B always has its parent in the previous depth's top-B,
so a width-B beam per depth holds the exact best-first tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_dartree import ops
from vllm_dartree.tree.heads import CorrectionHead, NoHead, gather_prefixes
from vllm_dartree.tree.structure import TreeBatch, truncate

__all__ = [
    "CandidateTables",
    "candidate_tables",
    "grow",
    "fixed_quotas",
    "pruned_quotas",
    "select_top_b",
    "build_dartree",
    "build_ddtree",
    "build_chain",
    "build_chain_ddtree",
]


@dataclass(frozen=True, slots=True)
class CandidateTables:
    ids: torch.Tensor       # [R, D, K] int64, top-K base-logit tokens per depth, best first
    logits: torch.Tensor    # [R, D, K] float32 (float64 in tests), their base logits
    log_norm: torch.Tensor  # [R, D] same dtype, logsumexp of the full-vocabulary base logits
    #                         (NaN at depths that are renormalised over K instead)
    columns: torch.Tensor | None = None   # [R, D, K] the candidates' columns in the logits
    #   (= the rows of a head's output projection) when the drafter scores a reduced draft
    #   vocabulary; None when the logits span the target's vocabulary (columns == ids)

    @property
    def head_ids(self) -> torch.Tensor:
        """What a correction head's `prepare` indexes its output projection with."""
        return self.ids if self.columns is None else self.columns


def candidate_tables(base_logits: torch.Tensor, k: int,
                     num_normalised: int | None = None,
                     vocab_ids: torch.Tensor | None = None) -> CandidateTables:
    """base_logits [R, D, V] -> the shared per-depth candidates (top-k, k <= V).

    Only the first `num_normalised` depths (default all) get the full-vocabulary
    normaliser; the others are renormalised over their K candidates and never read it
    (NaN there), which saves a logsumexp over [R, D - 1, V] per round with a head.
    `vocab_ids` [V] maps the logits' columns to target token ids (a drafter with a reduced
    draft vocabulary); tokens outside it are never candidates.
    """
    logits = base_logits.to(torch.promote_types(base_logits.dtype, torch.float32))
    vals, ids = torch.topk(logits, k, dim=-1)
    columns = None
    if vocab_ids is not None:
        columns, ids = ids, vocab_ids[ids]
    depths = logits.shape[1] if num_normalised is None else min(num_normalised, logits.shape[1])
    log_norm = torch.full(logits.shape[:2], float("nan"), dtype=logits.dtype,
                          device=logits.device)
    log_norm[:, :depths] = torch.logsumexp(logits[:, :depths], dim=-1)
    return CandidateTables(ids=ids, logits=vals, log_norm=log_norm, columns=columns)


def pruned_quotas(num_depths: int, width: int, k: int) -> list[int]:
    """W nodes per depth, or all children when fewer exist (K at depth 1).

    NOTE: the released code caps W at K at every depth; we cap at the P * K children
    that exist, which is the same for W <= K (the paper's settings) and keeps the beam
    exact for W > K (DDTree runs through here with W = B).
    """
    quotas, parents = [], 1
    for _ in range(num_depths):
        quotas.append(min(width, parents * k))
        parents = quotas[-1]
    return quotas


def fixed_quotas(budget: int, num_depths: int, k: int) -> list[int]:
    """ceil(remaining / remaining depths) per depth, capped by what the parents can hold."""
    quotas, remaining, parents = [], budget, 1
    for d in range(num_depths):
        quota = min(remaining, math.ceil(remaining / (num_depths - d)), parents * k)
        quotas.append(quota)
        remaining, parents = remaining - quota, quota
    return [q for q in quotas if q > 0]


@torch.no_grad()
def grow(
    tables: CandidateTables,
    head: CorrectionHead,
    prepared: Any,
    root_tokens: torch.Tensor,
    quotas: list[int],
) -> TreeBatch:
    """Grow the depth-wise supertree; nodes come depth-major, best first within a depth.

    root_tokens: [R] int64. quotas[d] nodes are kept at depth d + 1 (len(quotas) <= D).
    """
    num_req, _, k = tables.ids.shape
    state = head.init(root_tokens)                                   # [R, 1, *S]
    parent_scores = tables.logits.new_zeros(num_req, 1)              # [R, P]
    parent_ids = root_tokens.new_full((num_req, 1), -1)              # [R, P] ledger index
    tokens, parents, scores, depths = [], [], [], []
    offset = 0
    for d, quota in enumerate(quotas):
        num_parents = parent_scores.shape[1]
        if d < head.num_uncorrected:
            logits = tables.logits[:, d, None, :].expand(num_req, num_parents, k)
            log_norm = tables.log_norm[:, d]
        else:
            logits = tables.logits[:, d, None, :] + head.score(prepared, d, state)
            log_norm = None
        step_scores, parent_pos, rank = ops.score_and_select(logits, parent_scores, log_norm, quota)
        step_tokens = torch.gather(tables.ids[:, d], 1, rank)         # [R, Q]
        tokens.append(step_tokens)
        parents.append(torch.gather(parent_ids, 1, parent_pos))
        scores.append(step_scores)
        depths.append(torch.full_like(step_tokens, d + 1))
        if d + 1 < len(quotas):
            state = head.advance(gather_prefixes(state, parent_pos), step_tokens)
        parent_scores = step_scores
        parent_ids = offset + torch.arange(quota, device=root_tokens.device).expand(num_req, -1)
        offset += quota
    cat = lambda xs: torch.cat(xs, dim=1)  # noqa: E731
    supertree = TreeBatch(cat(tokens), cat(parents), cat(depths), cat(scores),
                          num_nodes=root_tokens.new_full((num_req,), offset))
    return _drop_invalid(supertree)


def select_top_b(supertree: TreeBatch, budget: int, depth_bonus: float) -> TreeBatch:
    """Global top-B of `score + depth_bonus * depth`, back in topological order.

    The supertree must be depth-major (as `grow` makes it): a stable sort then breaks
    ties towards shallower nodes, i.e. towards ancestors, as Lemma 1 requires.
    """
    num_req, m = supertree.tokens.shape
    if budget >= m:
        return supertree
    key = supertree.scores + depth_bonus * supertree.depths.to(supertree.scores.dtype)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :budget]
    keep = torch.sort(order, dim=1).values                            # [R, B] topological
    # old ledger index -> new index; column 0 stands for the root (-1 -> -1).
    remap = keep.new_full((num_req, 1 + m), -1)
    remap.scatter_(1, keep + 1, torch.arange(budget, device=keep.device).expand(num_req, -1))
    old_parents = torch.gather(supertree.parents, 1, keep)
    pick = lambda t: torch.gather(t, 1, keep)  # noqa: E731
    pruned = TreeBatch(
        tokens=pick(supertree.tokens),
        parents=torch.gather(remap, 1, old_parents + 1),
        depths=pick(supertree.depths),
        scores=pick(supertree.scores),
        num_nodes=torch.clamp(supertree.num_nodes, max=budget),
    )
    return _drop_invalid(pruned)


def _drop_invalid(tree: TreeBatch) -> TreeBatch:
    """Move nodes with a -inf score (zero draft probability) to the padding at the end.

    Their descendants are -inf as well, so the valid nodes stay ancestor-closed; a stable
    order keeps them topological.
    """
    num_req, n = tree.tokens.shape
    valid = torch.isfinite(tree.scores) & (
        torch.arange(n, device=tree.tokens.device)[None, :] < tree.num_nodes[:, None])
    slots = torch.arange(n, device=tree.tokens.device).expand(num_req, -1)
    order = torch.sort(slots + n * (~valid).long(), dim=1).values % n
    remap = order.new_full((num_req, 1 + n), -1)
    remap.scatter_(1, order + 1, slots)
    pick = lambda t: torch.gather(t, 1, order)  # noqa: E731
    moved = TreeBatch(
        tokens=pick(tree.tokens),
        parents=torch.gather(remap, 1, pick(tree.parents) + 1),
        depths=pick(tree.depths),
        scores=pick(tree.scores),
        num_nodes=valid.sum(dim=1),
    )
    return truncate(moved, moved.num_nodes)


def build_dartree(
    tables: CandidateTables,
    head: CorrectionHead,
    prepared: Any,
    root_tokens: torch.Tensor,
    *,
    variant: str,
    budget: int,
    width: int,
    depth_bonus: float,
) -> TreeBatch:
    """DARTree: pruned (W per depth, then global top-B) or fixed (B spread over depths)."""
    num_depths, k = tables.ids.shape[1], tables.ids.shape[2]
    if variant == "pruned":
        supertree = grow(tables, head, prepared, root_tokens, pruned_quotas(num_depths, width, k))
        return select_top_b(supertree, budget, depth_bonus)
    if variant == "fixed":
        return grow(tables, head, prepared, root_tokens, fixed_quotas(budget, num_depths, k))
    raise ValueError(f"variant = {variant!r} must be 'pruned' or 'fixed'")


def build_ddtree(tables: CandidateTables, root_tokens: torch.Tensor, budget: int) -> TreeBatch:
    """DDTree's best-first top-B over the uncorrected marginals, as one batched beam.

    Use K = min(B, V) candidates per depth (as DDTree does) for the exact heap result.
    """
    num_depths, k = tables.ids.shape[1], tables.ids.shape[2]
    supertree = grow(tables, NoHead(), None, root_tokens, pruned_quotas(num_depths, budget, k))
    return select_top_b(supertree, budget, 0.0)


def build_chain(
    tables: CandidateTables, head: CorrectionHead, prepared: Any, root_tokens: torch.Tensor,
    budget: int | None = None,
) -> TreeBatch:
    """One greedy path over min(D, budget) depths: the argmax candidate at every depth,
    corrected by the head along the chain itself (Domino chain) or not (NoHead: DFlash
    chain). Like every builder, it never returns more than `budget` nodes."""
    depths = tables.ids.shape[1] if budget is None else min(budget, tables.ids.shape[1])
    return grow(tables, head, prepared, root_tokens, [1] * depths)


@torch.no_grad()
def build_chain_ddtree(
    tables: CandidateTables, head: CorrectionHead, prepared: Any, root_tokens: torch.Tensor,
    budget: int,
) -> TreeBatch:
    """"Domino chain + DDTree" (paper, Table 2): run the correction along the greedy chain
    only, then build DDTree's best-first tree from those chain-conditioned distributions
    (each depth's K candidates, renormalised), as if they were path-independent marginals."""
    num_req, num_depths, k = tables.ids.shape
    state = head.init(root_tokens)
    logits, norms = [], []
    for d in range(num_depths):
        base = tables.logits[:, d]                                          # [R, K]
        if d < head.num_uncorrected:
            row, norm = base, tables.log_norm[:, d]
        else:
            row = base + head.score(prepared, d, state)[:, 0]
            norm = torch.logsumexp(row, dim=-1)
        logits.append(row)
        norms.append(norm)
        if d + 1 < num_depths:
            best = torch.gather(tables.ids[:, d], 1, row.argmax(dim=-1, keepdim=True))
            state = head.advance(state, best)
    corrected = torch.stack(logits, dim=1)                                  # [R, D, K]
    vals, order = torch.sort(corrected, dim=-1, descending=True)
    chain_tables = CandidateTables(ids=torch.gather(tables.ids, 2, order), logits=vals,
                                   log_norm=torch.stack(norms, dim=1))   # no head reads it
    return build_ddtree(chain_tables, root_tokens, budget)
