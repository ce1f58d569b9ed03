"""Sequential best-first (max-heap) builders: readable references and the Table 2 baseline.

- `ddtree_heap`: DDTree exactly as Ringel & Romano state it. Pop the best prefix; it becomes
  a node; push its next sibling and its first child. Scores are sums of uncorrected
  log-marginals, so a node's children never depend on its own token.
- `best_first_select`: best-first selection of B nodes from an already materialised tree
  (the left side of Lemma 1).
- `build_sequential_heap`: the exact path-conditioned search the paper's Table 2 ablates:
  DDTree's heap, but every pop runs the correction head for the popped node's children
  before the next pop. Exact and sequential by nature: one request and one node at a time.

These run on the host, one request at a time (`.tolist()`, Python heaps); they are the
oracles for the batched builders in `build.py` and the baseline the benchmark times.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import torch

from vllm_dartree.tree.build import CandidateTables
from vllm_dartree.tree.heads import CorrectionHead
from vllm_dartree.tree.structure import TreeBatch

__all__ = ["ddtree_heap", "best_first_select", "build_sequential_heap"]

_Node = tuple[int, int, int, float]  # (token, parent, depth, score)


def _to_batch(per_request: list[list[_Node]], width: int, like: torch.Tensor) -> TreeBatch:
    """Pack per-request node lists (topological) into a padded TreeBatch of N = width."""
    num_req = len(per_request)
    tokens = torch.zeros(num_req, width, dtype=torch.long)
    parents = torch.full((num_req, width), -1, dtype=torch.long)
    depths = torch.zeros(num_req, width, dtype=torch.long)
    scores = torch.full((num_req, width), float("-inf"), dtype=like.dtype)
    for r, nodes in enumerate(per_request):
        for i, (tok, par, dep, sc) in enumerate(nodes):
            tokens[r, i], parents[r, i], depths[r, i], scores[r, i] = tok, par, dep, sc
    num_nodes = torch.tensor([len(n) for n in per_request], dtype=torch.long)
    return TreeBatch(*(t.to(like.device) for t in (tokens, parents, depths, scores, num_nodes)))


def ddtree_heap(tables: CandidateTables, budget: int) -> TreeBatch:
    """DDTree's heap over the uncorrected marginals: log q = logit - logsumexp(vocab)."""
    log_q = (tables.logits - tables.log_norm[..., None]).tolist()   # [R][D][K], best first
    ids = tables.ids.tolist()
    trees = []
    for r in range(len(ids)):
        num_depths, k = len(ids[r]), len(ids[r][0])
        nodes: list[_Node] = []
        tie = itertools.count()
        # entry: (-score, tie, depth, rank, parent node index, parent score)
        heap = [(-log_q[r][0][0], next(tie), 1, 0, -1, 0.0)]
        while heap and len(nodes) < budget:
            neg, _, depth, rank, parent, parent_score = heapq.heappop(heap)
            me = len(nodes)
            nodes.append((ids[r][depth - 1][rank], parent, depth, -neg))
            if rank + 1 < k:   # next sibling: same parent, next candidate
                sib = parent_score + log_q[r][depth - 1][rank + 1]
                heapq.heappush(heap, (-sib, next(tie), depth, rank + 1, parent, parent_score))
            if depth < num_depths:   # first child: best candidate one level down
                heapq.heappush(heap, (neg - log_q[r][depth][0], next(tie), depth + 1, 0, me, -neg))
        trees.append(nodes)
    return _to_batch(trees, budget, tables.logits)


def best_first_select(tree: TreeBatch, budget: int, depth_bonus: float) -> list[set[int]]:
    """Best-first selection of `budget` nodes of a materialised tree, by score + beta*depth.

    Returns, per request, the selected node indices. A child enters the heap only after its
    parent is popped, so ties always go to ancestors.
    """
    selected = []
    for r in range(tree.num_requests):
        n = int(tree.num_nodes[r])
        parents = tree.parents[r, :n].tolist()
        key = (tree.scores[r, :n] + depth_bonus * tree.depths[r, :n].to(tree.scores.dtype)).tolist()
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)
        heap = [(-key[i], i) for i in children.get(-1, [])]
        heapq.heapify(heap)
        chosen: set[int] = set()
        while heap and len(chosen) < budget:
            _, i = heapq.heappop(heap)
            chosen.add(i)
            for c in children.get(i, []):
                heapq.heappush(heap, (-key[c], c))
        selected.append(chosen)
    return selected


@torch.no_grad()
def build_sequential_heap(
    tables: CandidateTables,
    head: CorrectionHead,
    hidden: torch.Tensor | None,
    root_tokens: torch.Tensor,
    *,
    budget: int,
    depth_bonus: float = 0.0,
) -> TreeBatch:
    """Exact best-first search over corrected scores, one correction per pop.

    hidden: [R, D, H] backbone hidden states (None for heads that need none).
    """
    trees = []
    for r in range(tables.ids.shape[0]):
        one = CandidateTables(tables.ids[r:r + 1], tables.logits[r:r + 1],
                              tables.log_norm[r:r + 1],
                              None if tables.columns is None else tables.columns[r:r + 1])
        prepared = head.prepare(None if hidden is None else hidden[r:r + 1], one.head_ids)
        trees.append(_sequential_heap_one(one, head, prepared, root_tokens[r:r + 1], budget,
                                          depth_bonus))
    return _to_batch(trees, budget, tables.logits)


def _children(tables: CandidateTables, head: CorrectionHead, prepared: Any,
              depth: int, state: torch.Tensor) -> tuple[list[float], list[int]]:
    """Sorted (log q, token) of the K children at 0-based `depth` of one prefix (R = 1)."""
    base = tables.logits[:, depth]                                     # [1, K]
    if depth < head.num_uncorrected:
        log_q = base - tables.log_norm[:, depth, None]
    else:
        log_q = torch.log_softmax(base + head.score(prepared, depth, state)[:, 0], dim=-1)
    vals, order = torch.sort(log_q[0], descending=True)
    return vals.tolist(), tables.ids[0, depth][order].tolist()


def _sequential_heap_one(tables, head, prepared, root_tokens, budget, beta) -> list[_Node]:
    num_depths = tables.ids.shape[1]
    root_state = head.init(root_tokens)                                # [1, 1, *S]
    nodes: list[_Node] = []
    tie = itertools.count()
    # sorted children of each expanded prefix: prefix node index (-1 = root) -> (log q, tokens)
    kids = {-1: _children(tables, head, prepared, 0, root_state)}
    states = {-1: root_state}
    heap = [(-(kids[-1][0][0] + beta), next(tie), 1, 0, -1, 0.0)]
    while heap and len(nodes) < budget:
        _, _, depth, rank, parent, parent_score = heapq.heappop(heap)
        log_q, toks = kids[parent]
        score = parent_score + log_q[rank]
        me = len(nodes)
        nodes.append((toks[rank], parent, depth, score))
        if rank + 1 < len(toks):
            sib = parent_score + log_q[rank + 1] + beta * depth
            heapq.heappush(heap, (-sib, next(tie), depth, rank + 1, parent, parent_score))
        if depth < num_depths:
            token = torch.tensor([[toks[rank]]], device=tables.ids.device)
            states[me] = head.advance(states[parent], token)
            kids[me] = _children(tables, head, prepared, depth, states[me])
            child = score + kids[me][0][0] + beta * (depth + 1)
            heapq.heappush(heap, (-child, next(tie), depth + 1, 0, me, score))
    return nodes
