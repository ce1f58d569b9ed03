"""Tree builders: invariants, brute-force oracles, Lemma 1, and batched == per-request."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_valid_tree, node_paths, path_of
from vllm_dartree.drafter import DominoGRUHead
from vllm_dartree.tree import (
    MarkovToyHead,
    NoHead,
    best_first_select,
    build_chain,
    build_dartree,
    build_ddtree,
    build_sequential_heap,
    candidate_tables,
    ddtree_heap,
    fixed_quotas,
    grow,
    pruned_quotas,
    select_top_b,
)


def _setup(seed, num_req, depth, vocab, head_kind="markov", dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(num_req, depth, vocab, generator=gen)).to(dtype)
    roots = torch.randint(0, vocab, (num_req,), generator=gen)
    hidden = None
    if head_kind == "markov":
        head = MarkovToyHead(torch.randn(depth, vocab, vocab, generator=gen, dtype=dtype))
    elif head_kind == "gru":
        hsz, gsz, emb = 8, 6, 5
        embed = torch.randn(vocab, hsz, generator=gen, dtype=dtype)
        head = DominoGRUHead(hsz, gsz, emb, vocab, embed).to(dtype)
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype))
        hidden = torch.randn(num_req, depth, hsz, generator=gen, dtype=dtype)
    else:
        head = NoHead()
    return logits, roots, head, hidden


def _dartree(logits, roots, head, hidden, variant, budget, width, k, beta):
    tables = candidate_tables(logits, k)
    return build_dartree(tables, head, head.prepare(hidden, tables.ids), roots,
                         variant=variant, budget=budget, width=width, depth_bonus=beta)


sizes = st.tuples(
    st.integers(0, 2**31),   # seed
    st.integers(1, 3),       # R
    st.integers(1, 6),       # D
    st.integers(2, 12),      # V
    st.integers(1, 40),      # B
    st.integers(1, 8),       # W
    st.integers(1, 12),      # K (capped by V and B)
    st.floats(-1.0, 0.0),    # beta
    st.sampled_from(["markov", "gru", "none"]),
)


@settings(max_examples=60, deadline=None)
@given(sizes)
def test_builders_make_valid_trees(args):
    seed, num_req, depth, vocab, budget, width, k, beta, kind = args
    logits, roots, head, hidden = _setup(seed, num_req, depth, vocab, kind)
    k = min(k, vocab, budget)
    pruned = _dartree(logits, roots, head, hidden, "pruned", budget, width, k, beta)
    assert_valid_tree(pruned, budget, depth)
    fixed = _dartree(logits, roots, head, hidden, "fixed", budget, width, k, beta)
    assert_valid_tree(fixed, budget, depth)
    quotas = fixed_quotas(budget, depth, k)
    assert fixed.num_nodes.tolist() == [sum(quotas)] * num_req
    if budget <= sum(k ** d for d in range(1, depth + 1)) and budget <= depth * k:
        assert sum(quotas) == budget          # exactly B nodes whenever B of them fit
    for d, q in enumerate(quotas, start=1):   # ceil(remaining / remaining depths) per depth
        assert (fixed.depths == d).sum(1).tolist() == [q] * num_req
    tables = candidate_tables(logits, k)
    supertree = grow(tables, head, head.prepare(hidden, tables.ids), roots,
                     pruned_quotas(depth, width, k))
    for d in range(1, depth + 1):             # the supertree keeps <= W nodes per depth
        assert ((supertree.depths == d).sum(1) <= width).all()
    assert_valid_tree(build_chain(tables, head, head.prepare(hidden, tables.ids), roots),
                      depth, depth)
    ddt = build_ddtree(candidate_tables(logits, min(budget, vocab)), roots, budget)
    assert_valid_tree(ddt, budget, depth)


@settings(max_examples=40, deadline=None)
@given(sizes)
def test_batched_equals_per_request(args):
    seed, num_req, depth, vocab, budget, width, k, beta, kind = args
    logits, roots, head, hidden = _setup(seed, num_req, depth, vocab, kind)
    k = min(k, vocab, budget)
    for variant in ("pruned", "fixed"):
        batched = _dartree(logits, roots, head, hidden, variant, budget, width, k, beta)
        for r in range(num_req):
            sl = slice(r, r + 1)
            alone = _dartree(logits[sl], roots[sl], head, None if hidden is None else hidden[sl],
                             variant, budget, width, k, beta)
            one = batched.request(r)
            assert torch.equal(one.tokens, alone.tokens) and torch.equal(one.parents, alone.parents)
            assert torch.allclose(one.scores, alone.scores, equal_nan=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 5), st.integers(2, 10), st.integers(1, 40),
       st.integers(1, 10), st.floats(-1.0, 0.0), st.sampled_from(["markov", "gru", "none"]))
def test_lemma1_top_b_equals_best_first(seed, depth, vocab, budget, width, beta, kind):
    """Lemma 1: on a materialised supertree, global top-B == best-first heap (beta <= 0)."""
    logits, roots, head, hidden = _setup(seed, 2, depth, vocab, kind)
    tables = candidate_tables(logits, vocab)
    supertree = grow(tables, head, head.prepare(hidden, tables.ids), roots,
                     pruned_quotas(depth, width, vocab))
    top_b = select_top_b(supertree, budget, beta)
    heap = best_first_select(supertree, budget, beta)
    for r in range(2):
        chosen = set(node_paths(top_b, r))
        assert chosen == {path_of(supertree, r, i) for i in heap[r]}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 3), st.integers(1, 5), st.integers(1, 12),
       st.floats(-0.8, 0.0), st.sampled_from(["markov", "gru"]))
def test_dartree_with_width_b_equals_sequential_heap(seed, num_req, depth, budget, beta, kind):
    """With W >= B and K >= B, the depth-wise beam holds the exact best-first tree."""
    vocab = budget + 3
    logits, roots, head, hidden = _setup(seed, num_req, depth, vocab, kind)
    tables = candidate_tables(logits, budget)
    ours = build_dartree(tables, head, head.prepare(hidden, tables.ids), roots,
                         variant="pruned", budget=budget, width=budget, depth_bonus=beta)
    heap = build_sequential_heap(tables, head, hidden, roots, budget=budget, depth_bonus=beta)
    for r in range(num_req):
        a, b = node_paths(ours, r), node_paths(heap, r)
        assert a.keys() == b.keys()
        for path, score in a.items():
            assert math.isclose(score, b[path], rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 3), st.integers(1, 6), st.integers(2, 20),
       st.integers(1, 64))
def test_batched_ddtree_equals_heap(seed, num_req, depth, vocab, budget):
    logits, roots, _, _ = _setup(seed, num_req, depth, vocab, "none")
    tables = candidate_tables(logits, min(budget, vocab))
    ours, heap = build_ddtree(tables, roots, budget), ddtree_heap(tables, budget)
    assert ours.num_nodes.tolist() == heap.num_nodes.tolist()
    for r in range(num_req):
        a, b = node_paths(ours, r), node_paths(heap, r)
        assert a.keys() == b.keys()
        assert all(math.isclose(a[p], b[p], abs_tol=1e-9) for p in a)


def _explicit_score(path, logits_r, head, root, k):
    """Brute force: the DARTree score of one token path, from the definitions."""
    total, prev = 0.0, root
    for d, tok in enumerate(path):
        base = logits_r[d]
        cand = torch.topk(base, k).indices.tolist()
        assert tok in cand
        if d < head.num_uncorrected:
            total += float(base[tok] - torch.logsumexp(base, 0))
        else:
            corrected = torch.tensor([float(base[c] + head.table[d, prev, c]) for c in cand],
                                     dtype=torch.float64)
            total += float(torch.log_softmax(corrected, 0)[cand.index(tok)])
        prev = tok
    return total


@pytest.mark.parametrize("seed", range(4))
def test_scores_equal_explicit_enumeration(seed):
    """Fixed variant with a budget that materialises every path: all K^d scores match."""
    depth, vocab, k = 3, 5, 3
    logits, roots, head, _ = _setup(seed, 2, depth, vocab, "markov")
    full = sum(k ** d for d in range(1, depth + 1))
    tree = _dartree(logits, roots, head, None, "fixed", full, 1, k, 0.0)
    for r in range(2):
        got = node_paths(tree, r)
        cands = [torch.topk(logits[r, d], k).indices.tolist() for d in range(depth)]
        expected = {p: _explicit_score(p, logits[r], head, int(roots[r]), k)
                    for d in range(1, depth + 1) for p in itertools.product(*cands[:d])}
        assert got.keys() == expected.keys()
        assert all(math.isclose(got[p], expected[p], abs_tol=1e-9) for p in got)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget,width,beta", [(5, 2, -0.2), (9, 3, 0.0), (4, 6, -1.0)])
def test_pruned_equals_brute_force_beam(seed, budget, width, beta):
    """Explicit depth-wise beam over enumerated children, then global top-B with the bonus."""
    depth, vocab, k = 4, 6, 4
    logits, roots, head, _ = _setup(seed, 1, depth, vocab, "markov")
    kk = min(k, budget)
    tree = _dartree(logits, roots, head, None, "pruned", budget, width, kk, beta)
    cands = [torch.topk(logits[0, d], kk).indices.tolist() for d in range(depth)]
    score = lambda p: _explicit_score(p, logits[0], head, int(roots[0]), kk)  # noqa: E731
    beam, supertree = [()], []
    for d in range(depth):
        children = sorted((p + (t,) for p in beam for t in cands[d]), key=score, reverse=True)
        beam = children[:min(width, kk)]
        supertree += beam
    expected = sorted(supertree, key=lambda p: score(p) + beta * len(p), reverse=True)[:budget]
    assert set(node_paths(tree, 0)) == set(expected)


def test_ties_go_to_ancestors():
    """Children with log q = 0 tie with their parent; the cut must still be ancestor-closed."""
    depth, vocab = 3, 4
    logits = torch.zeros(1, depth, vocab, dtype=torch.float64)
    logits[0, 0] = torch.tensor([0.0, -1.0, -2.0, -3.0])
    logits[0, 1:, 2] = 1e4                      # depths 2, 3: token 2 has probability 1
    roots = torch.tensor([0])
    for budget in (1, 2, 3):
        tree = _dartree(logits, roots, NoHead(), None, "pruned", budget, 4, 4, 0.0)
        assert_valid_tree(tree, budget, depth)
        assert set(node_paths(tree, 0)) == set([(0,), (0, 2), (0, 2, 2)][:budget])


def test_zero_probability_candidates_are_dropped():
    depth, vocab = 3, 6
    logits = torch.randn(2, depth, vocab, dtype=torch.float64)
    logits[:, :, 3:] = float("-inf")            # only 3 tokens per depth are possible
    roots = torch.tensor([0, 1])
    tree = _dartree(logits, roots, NoHead(), None, "pruned", 30, 6, 6, -0.1)
    assert_valid_tree(tree, 30, depth)
    assert tree.num_nodes.tolist() == [3 + 6 + 6] * 2   # 3 finite at depth 1, then W = 6
    fixed = _dartree(logits, roots, NoHead(), None, "fixed", 12, 1, 6, 0.0)
    assert_valid_tree(fixed, 12, depth)
    assert (fixed.tokens[fixed.scores.isfinite()] < 3).all()


def test_chain_is_the_corrected_greedy_path():
    depth, vocab, k = 5, 9, 4
    logits, roots, head, _ = _setup(7, 3, depth, vocab, "markov")
    tables = candidate_tables(logits, k)
    chain = build_chain(tables, head, head.prepare(None, tables.ids), roots)
    for r in range(3):
        prev, expected = int(roots[r]), []
        for d in range(depth):
            cand = torch.topk(logits[r, d], k).indices
            corr = head.table[d, prev, cand] if d >= head.num_uncorrected else 0
            prev = int(cand[torch.argmax(logits[r, d, cand] + corr)])
            expected.append(prev)
        assert chain.tokens[r].tolist() == expected
        assert chain.parents[r].tolist() == list(range(-1, depth - 1))
