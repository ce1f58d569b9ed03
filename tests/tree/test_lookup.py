"""Lookup branches: the incremental n-gram index against a brute-force scan, grafting onto
drafter trees (ancestor-closed, no duplicate siblings, within the budget) and the best-first
order of a merged tree, the lookup nodes' prior."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dartree.tree.lookup import (
    BOTH,
    DRAFTER,
    LOOKUP,
    Continuation,
    LookupIndex,
    best_first,
    lookup_scores,
    merge_branches,
    reorder,
)


def brute_force(seq, min_n, max_n, length, candidates, max_match=None):
    """Scan the whole sequence for each suffix length, longest first, most recent first;
    a match of order max_n is measured by the longest common suffix (up to max_match)."""
    out = []
    total = len(seq)
    cap = max(max_n, max_match or max_n)

    def extent(e, n):
        if n < max_n:
            return n
        return max(m for m in range(n, cap + 1) if m <= e and seq[e - m:e] == seq[total - m:])
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = seq[total - n:]
        ends = [e for e in range(n, total) if seq[e - n:e] == suffix]
        for e in reversed(ends):
            cont = tuple(seq[e:e + length])
            kept = [i for i, c in enumerate(out)
                    if c[0][:len(cont)] == cont or cont[:len(c[0])] == c[0]]
            if not kept:
                out.append((cont, n, sum(seq[x] == cont[0] for x in ends), extent(e, n)))
                if len(out) >= candidates:
                    return out
            elif len(cont) > len(out[kept[0]][0]):
                out[kept[0]] = (cont, n, sum(seq[x] == cont[0] for x in ends), extent(e, n))
    return out


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       chunks=st.integers(1, 5), min_n=st.integers(1, 3), extra=st.integers(0, 3),
       length=st.integers(1, 6), candidates=st.integers(1, 5), root=st.integers(0, 3),
       further=st.integers(0, 12))
def test_index_equals_a_brute_force_scan(seq, chunks, min_n, extra, length, candidates, root,
                                         further):
    index = LookupIndex(min_n, min_n + extra, min_n + extra + further)
    step = max(1, len(seq) // chunks)
    for start in range(0, len(seq), step):          # incremental, in uneven pieces
        index.extend(seq[start:start + step])
    got = index.propose(root, length, candidates)
    want = brute_force(seq + [root], min_n, min_n + extra, length, candidates,
                       min_n + extra + further)
    assert [(c.tokens, c.match, c.count, c.extent) for c in got] == want
    full = seq + [root]
    for c in got:    # each continuation really follows an occurrence of its whole match
        assert c.match <= c.matched <= min_n + extra + further
        suffix = full[len(full) - c.matched:]
        assert any(full[e - c.matched:e] == suffix
                   and tuple(full[e:e + len(c.tokens)]) == c.tokens
                   for e in range(c.matched, len(full)))


def test_repeated_text_proposes_its_continuation():
    index = LookupIndex(2, 4)
    text = [5, 6, 7, 8, 9, 10, 11]
    index.extend(text + [1, 2] + text[:3])
    best = index.propose(None, 4, 2)[0]
    assert best == Continuation((8, 9, 10, 11), 3, 1, 3)


def test_a_long_copy_is_measured_past_the_ngram_order_and_trusted_further():
    """A copy that has matched 12 tokens carries extent 12 (n-gram order 4), and its nodes'
    prior is above a 4-token coincidence's at every depth; max_match bounds the extent."""
    text = list(range(10, 30))
    history = text + [1, 2] + text[:12]
    long_copy = LookupIndex(2, 4, 64)
    long_copy.extend(history)
    best = long_copy.propose(None, 6, 1)[0]
    assert (best.tokens, best.match, best.extent) == (tuple(text[12:18]), 4, 12)
    capped = LookupIndex(2, 4, 7)
    capped.extend(history)
    assert capped.propose(None, 6, 1)[0].extent == 7
    plain = LookupIndex(2, 4)          # max_match defaults to the n-gram order
    plain.extend(history)
    assert plain.propose(None, 6, 1)[0].matched == 4
    short = [40, 41, 42, 43] + [10, 11, 12, 13, 14, 15] + [3] + [40, 41, 42, 43]
    coincidence = LookupIndex(2, 4, 64)
    coincidence.extend(short)
    assert coincidence.propose(None, 6, 1)[0].extent == 4
    trees = [merge_branches([], [], [], [], [c], 6) for c in (best, Continuation(
        best.tokens, 4, 1, 4))]
    assert (np.asarray(trees[0].scores) > np.asarray(trees[1].scores)).all()


def _random_tree(rng, n, vocab):
    parents, tokens, depths = [], [], []
    for i in range(n):
        p = int(rng.integers(-1, i)) if i else -1
        siblings = {t for q, t in zip(parents, tokens) if q == p}
        free = [t for t in range(vocab) if t not in siblings]
        if not free:
            p, free = -1, [t for t in range(vocab)
                           if t not in {t2 for q, t2 in zip(parents, tokens) if q == -1}]
            if not free:
                break
        parents.append(p)
        tokens.append(int(rng.choice(free)))
        depths.append(1 if p < 0 else depths[p] + 1)
    return tokens, parents, depths


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(0, 12), max_new=st.integers(0, 10))
def test_grafted_tree_is_a_tree_within_budget(seed, n, max_new):
    rng = np.random.default_rng(seed)
    tokens, parents, depths = _random_tree(rng, n, vocab=4)
    scores = [-0.3 * d for d in depths]
    conts = [Continuation(tuple(int(t) for t in rng.integers(0, 4, int(rng.integers(1, 6)))),
                          int(rng.integers(1, 5)), int(rng.integers(1, 3)))
             for _ in range(int(rng.integers(1, 4)))]
    tree = merge_branches(tokens, parents, depths, scores, conts, max_new)
    m = len(tree.tokens)
    assert tree.tokens[:len(tokens)] == tokens and tree.parents[:len(tokens)] == parents
    assert m - len(tokens) <= max_new
    assert sum(s == LOOKUP for s in tree.sources) == m - len(tokens)
    pairs = set()
    for i in range(m):
        p = tree.parents[i]
        assert p < i
        assert tree.depths[i] == (1 if p < 0 else tree.depths[p] + 1)
        assert (p, tree.tokens[i]) not in pairs            # no duplicate siblings
        pairs.add((p, tree.tokens[i]))
    # every continuation's path is in the tree as far as the budget allowed, in order
    children = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    for c in conts:
        node = -1
        for tok in c.tokens:
            if (node, tok) not in children:
                break
            node = children[(node, tok)]
            assert tree.sources[node] in (LOOKUP, BOTH)
    if max_new >= sum(len(c.tokens) for c in conts):     # room for everything: all present
        for c in conts:
            node = -1
            for tok in c.tokens:
                node = children[(node, tok)]
    for i in range(len(tokens)):
        assert tree.sources[i] in (DRAFTER, BOTH)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 15))
def test_best_first_prefixes_are_trees_ranked_by_capped_estimate(seed, n):
    rng = np.random.default_rng(seed)
    tokens, parents, depths = _random_tree(rng, n, vocab=5)
    conts = [Continuation((1, 2, 3), 2, 1)]
    tree = merge_branches(tokens, parents, depths, [-0.5] * len(tokens), conts, 3)
    p = rng.random(len(tree.tokens)).round(1)          # ties on purpose
    order = best_first(p, tree.parents, tree.depths)
    ranked = reorder(tree, order)
    capped = []
    for i in order:                                      # min of p along the path
        v, j = p[i], tree.parents[i]
        while j >= 0:
            v, j = min(v, p[j]), tree.parents[j]
        capped.append(v)
    assert all(a >= b for a, b in zip(capped, capped[1:]))
    for i, parent in enumerate(ranked.parents):          # every prefix is ancestor-closed
        assert parent < i
        assert ranked.tokens[i] == tree.tokens[order[i]]
        if parent >= 0:
            assert ranked.depths[i] == ranked.depths[parent] + 1


@given(match=st.integers(1, 12), count=st.integers(1, 9), extra=st.integers(0, 9),
       length=st.integers(1, 40))
def test_lookup_prior_falls_with_depth_and_rises_with_the_match(match, count, extra, length):
    """The prior of a continuation's nodes: at depth 1 the share of the match's occurrences
    that continue with this token times match / (match + 1); it falls with every depth, more
    slowly than that first factor (a copy that started right tends to go on); a longer
    matched suffix never scores lower at any depth."""
    total = count + extra
    prior = lookup_scores(match, count, total, length)
    assert prior.shape == (length,)
    np.testing.assert_allclose(prior[0], np.log(count / total * match / (match + 1)))
    steps = np.diff(prior)
    assert (steps < 0).all()
    assert (steps > np.log(match / (match + 1))).all()
    assert (lookup_scores(match + 1, count, total, length) >= prior).all()
