"""`build_tree`: one entry point that builds the tree a DARTreeConfig asks for.

Engines call this once per round with the backbone's outputs; it picks the builder
(`dartree` fixed/pruned, `ddtree`, `chain`, `sequential-heap`, `chain-ddtree`), the candidate
count and whether the correction head is used, so that every method runs on the same
drafter.
"""

from __future__ import annotations

import torch

from vllm_dartree.config import DARTreeConfig
from vllm_dartree.tree.build import (
    build_chain,
    build_chain_ddtree,
    build_dartree,
    build_ddtree,
    candidate_tables,
)
from vllm_dartree.tree.heads import CorrectionHead, NoHead
from vllm_dartree.tree.heap import build_sequential_heap
from vllm_dartree.tree.structure import TreeBatch, best_first_order

__all__ = ["build_tree", "num_candidates"]


def num_candidates(config: DARTreeConfig, vocab_size: int) -> int:
    """K actually used: DDTree takes min(B, V) (its heap's rule); the others min(K, V, B)."""
    if config.builder == "ddtree":
        return min(config.budget, vocab_size)
    if config.builder in ("chain", "chain-ddtree"):
        return min(config.topk, vocab_size)
    return min(config.topk, vocab_size, config.budget)


def build_tree(
    config: DARTreeConfig,
    base_logits: torch.Tensor,
    hidden: torch.Tensor | None,
    root_tokens: torch.Tensor,
    head: CorrectionHead | None,
    vocab_ids: torch.Tensor | None = None,
) -> TreeBatch:
    """Build this round's trees for R requests.

    base_logits: [R, D, V] the backbone's logits per draft depth; hidden: [R, D, H] its
    hidden states (what the correction head reads); root_tokens: [R] int64, the last
    committed token of each request; vocab_ids: [V] the target ids of the logits' columns for
    a drafter with a reduced draft vocabulary (None: the columns are target ids). Returns a TreeBatch of static width, at most
    `budget` nodes per request, in best-first order (`best_first_order`): any prefix is the
    best tree of its size.
    """
    tree = _build(config, base_logits, hidden, root_tokens, head, vocab_ids)
    # DDTree ranks by plain path score; the others by score + beta * depth.
    beta = 0.0 if config.builder in ("ddtree", "chain-ddtree") else config.depth_bonus
    return best_first_order(tree, beta)


def _build(config, base_logits, hidden, root_tokens, head, vocab_ids) -> TreeBatch:
    vocab = base_logits.shape[-1]
    config.check_drafter(vocab_size=vocab, num_depths=base_logits.shape[1])
    depths = config.num_depths(base_logits.shape[1])
    if hidden is not None:
        hidden = hidden[:, :depths]
    if head is None or not config.correction:
        head = NoHead()
    tables = candidate_tables(base_logits[:, :depths], num_candidates(config, vocab),
                              num_normalised=head.num_uncorrected, vocab_ids=vocab_ids)
    if config.builder == "ddtree":
        return build_ddtree(tables, root_tokens, config.budget)
    if config.builder == "sequential-heap":
        return build_sequential_heap(tables, head, hidden, root_tokens, budget=config.budget,
                                     depth_bonus=config.depth_bonus)
    prepared = head.prepare(hidden, tables.head_ids)
    if config.builder == "chain":
        return build_chain(tables, head, prepared, root_tokens, config.budget)
    if config.builder == "chain-ddtree":
        return build_chain_ddtree(tables, head, prepared, root_tokens, config.budget)
    return build_dartree(tables, head, prepared, root_tokens, variant=config.variant,
                         budget=config.budget, width=config.width,
                         depth_bonus=config.depth_bonus)
