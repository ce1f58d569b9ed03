"""Host-side oracles shared by the tests (sequential on purpose: they are the references)."""

from __future__ import annotations

import torch

from vllm_dartree.tree import TreeBatch


def assert_valid_tree(tree: TreeBatch, budget: int | None = None, max_depth: int | None = None):
    """Every DESIGN.md invariant of a tree batch, checked one request at a time."""
    for r in range(tree.num_requests):
        n = int(tree.num_nodes[r])
        toks = tree.tokens[r].tolist()
        par = tree.parents[r].tolist()
        dep = tree.depths[r].tolist()
        sc = tree.scores[r].tolist()
        if budget is not None:
            assert n <= budget
        seen_children: dict[int, set[int]] = {}
        for i in range(n):
            p = par[i]
            assert -1 <= p < i, f"request {r}: node {i} has parent {p} (topological order)"
            assert dep[i] == (1 if p < 0 else dep[p] + 1), f"request {r}: depth of node {i}"
            if max_depth is not None:
                assert dep[i] <= max_depth
            kids = seen_children.setdefault(p, set())
            assert toks[i] not in kids, f"request {r}: duplicate sibling token {toks[i]}"
            kids.add(toks[i])
            assert sc[i] > float("-inf")
        for i in range(n, tree.max_nodes):
            assert (toks[i], par[i], dep[i], sc[i]) == (0, -1, 0, float("-inf")), "padding"


def path_of(tree: TreeBatch, r: int, i: int) -> tuple[int, ...]:
    """Token path from the root to node i of request r."""
    out = []
    while i >= 0:
        out.append(int(tree.tokens[r, i]))
        i = int(tree.parents[r, i])
    return tuple(reversed(out))


def node_paths(tree: TreeBatch, r: int) -> dict[tuple[int, ...], float]:
    """All valid nodes of request r as {token path: score}."""
    return {path_of(tree, r, i): float(tree.scores[r, i]) for i in range(int(tree.num_nodes[r]))}


def row_copy_mask(parents: list[int]) -> torch.Tensor:
    """DDTree's sequential construction: a node's row is its parent's row plus itself."""
    n = len(parents)
    vis = torch.zeros(1 + n, 1 + n, dtype=torch.bool)
    vis[0, 0] = True
    for i, p in enumerate(parents):
        vis[i + 1] = vis[p + 1]
        vis[i + 1, i + 1] = True
    return vis


def random_parents(num_req: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[R, N] random topological parent arrays (parents[i] uniform in [-1, i))."""
    parents = torch.full((num_req, n), -1, dtype=torch.long)
    for i in range(1, n):
        parents[:, i] = torch.randint(-1, i, (num_req,), generator=gen)
    return parents
