"""build_tree: the config picks the builder, K, the depth limit and the head."""

import pytest
import torch

from tests.helpers import assert_valid_tree, node_paths
from vllm_dartree import DARTreeConfig
from vllm_dartree.tree import (
    MarkovToyHead,
    NoHead,
    best_first_select,
    build_chain,
    build_dartree,
    build_ddtree,
    build_sequential_heap,
    build_tree,
    candidate_tables,
)

R, D, V = 3, 6, 40


@pytest.fixture
def inputs():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(R, D, V, generator=gen, dtype=torch.float64)
    head = MarkovToyHead(torch.randn(D, V, V, generator=gen, dtype=torch.float64))
    return logits, torch.randint(0, V, (R,), generator=gen), head


def _same(a, b):
    assert all(node_paths(a, r) == pytest.approx(node_paths(b, r)) for r in range(R))


@pytest.mark.parametrize("variant", ["pruned", "fixed"])
def test_dartree(inputs, variant):
    logits, roots, head = inputs
    cfg = DARTreeConfig(variant=variant, budget=10, width=4, topk=8)
    tables = candidate_tables(logits, 8)
    _same(build_tree(cfg, logits, None, roots, head),
          build_dartree(tables, head, tables.ids, roots, variant=variant, budget=10, width=4,
                        depth_bonus=-0.2))


def test_ddtree_uses_min_budget_vocab_candidates(inputs):
    logits, roots, head = inputs
    cfg = DARTreeConfig(builder="ddtree", budget=12, topk=4)
    _same(build_tree(cfg, logits, None, roots, head),
          build_ddtree(candidate_tables(logits, 12), roots, 12))


def test_chain_and_correction_off(inputs):
    logits, roots, head = inputs
    tables = candidate_tables(logits, 8)
    chain = build_tree(DARTreeConfig(builder="chain", topk=8), logits, None, roots, head)
    _same(chain, build_chain(tables, head, tables.ids, roots))
    dflash = build_tree(DARTreeConfig(builder="chain", topk=8, correction=False), logits, None,
                        roots, head)
    assert torch.equal(dflash.tokens, logits.argmax(-1))     # uncorrected marginals' argmax
    _same(build_tree(DARTreeConfig(topk=8, correction=False, budget=9), logits, None, roots, head),
          build_dartree(tables, NoHead(), None, roots, variant="pruned", budget=8 + 1, width=12,
                        depth_bonus=-0.2))


def test_sequential_heap_and_max_depth(inputs):
    logits, roots, head = inputs
    cfg = DARTreeConfig(builder="sequential-heap", budget=7, topk=5, max_depth=3)
    tree = build_tree(cfg, logits, None, roots, head)
    assert_valid_tree(tree, 7, 3)
    _same(tree, build_sequential_heap(candidate_tables(logits[:, :3], 5), head, None, roots,
                                      budget=7, depth_bonus=-0.2))


def test_config_errors_surface(inputs):
    logits, roots, head = inputs
    with pytest.raises(ValueError, match="max_depth"):
        build_tree(DARTreeConfig(max_depth=D + 1, topk=8), logits, None, roots, head)
    with pytest.raises(ValueError, match="topk"):
        build_tree(DARTreeConfig(topk=V + 1), logits, None, roots, head)


def test_chain_ddtree(inputs):
    """DDTree over the chain-conditioned distributions: every node's score is the sum of
    log q along its path, q renormalised over K with the correction of the greedy chain."""
    logits, roots, head = inputs
    k, budget = 6, 12
    tree = build_tree(DARTreeConfig(builder="chain-ddtree", budget=budget, topk=k), logits,
                      None, roots, head)
    assert_valid_tree(tree, budget, D)
    for r in range(R):
        prev, log_q = int(roots[r]), []
        for d in range(D):
            cand = torch.topk(logits[r, d], k).indices
            if d == 0:
                lq = torch.log_softmax(logits[r, d], -1)[cand]
            else:
                lq = torch.log_softmax(logits[r, d, cand] + head.table[d, prev, cand], -1)
            log_q.append(dict(zip(cand.tolist(), lq.tolist())))
            prev = int(cand[lq.argmax()])
        for path, score in node_paths(tree, r).items():
            assert score == pytest.approx(sum(log_q[d][t] for d, t in enumerate(path)))
    # without a head it is plain DDTree over the same K candidates
    plain = build_tree(DARTreeConfig(builder="chain-ddtree", budget=budget, topk=k,
                                     correction=False), logits, None, roots, head)
    _same(plain, build_ddtree(candidate_tables(logits, k), roots, budget))


BUILDERS = [dict(builder="dartree", variant="pruned"), dict(builder="dartree", variant="fixed"),
            dict(builder="ddtree"), dict(builder="chain"), dict(builder="sequential-heap"),
            dict(builder="chain-ddtree"), dict(builder="dartree", correction=False)]


@pytest.mark.parametrize("keys", BUILDERS, ids=lambda k: "-".join(map(str, k.values())))
def test_every_prefix_is_the_best_tree_of_its_size(inputs, keys):
    """Best-first order: for every n <= B the first n nodes are the best-first selection of
    n nodes of the tree (by score + beta * depth; plain score for DDTree's builders)."""
    logits, roots, head = inputs
    cfg = DARTreeConfig(budget=11, width=4, topk=6, **keys)
    tree = build_tree(cfg, logits, None, roots, head)
    assert_valid_tree(tree, 11, D)
    beta = 0.0 if cfg.builder in ("ddtree", "chain-ddtree") else cfg.depth_bonus
    for n in range(1, 12):
        for r, chosen in enumerate(best_first_select(tree, n, beta)):
            assert chosen == set(range(min(n, int(tree.num_nodes[r])))), (n, r)


@pytest.mark.parametrize("keys", BUILDERS, ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("budget", [1, 3, D - 1])
def test_every_builder_respects_a_budget_below_the_depth(inputs, keys, budget):
    """No builder returns more than `budget` nodes, even when budget < the drafter's depth
    (the chain once emitted one node per depth, which crashed vLLM's per-position counters)."""
    logits, roots, head = inputs
    tree = build_tree(DARTreeConfig(budget=budget, width=4, topk=6, **keys), logits, None,
                      roots, head)
    assert_valid_tree(tree, budget, D)
    assert int(tree.num_nodes.max()) == budget
