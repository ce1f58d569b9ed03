"""Verification walks: golden paths, a brute-force oracle, and sampled losslessness."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from tests.helpers import path_of
from vllm_dartree.tree import (
    MarkovToyHead,
    TreeBatch,
    build_dartree,
    candidate_tables,
    greedy_walk,
    sample_target_tokens,
    sampled_walk,
    walk,
)

# root ─ a=5(0) ─ c=7(2) ─ e=9(4)
#      └ b=6(1) ─ d=7(3)
GOLDEN = TreeBatch(
    tokens=torch.tensor([[5, 6, 7, 7, 9, 0]]),
    parents=torch.tensor([[-1, -1, 0, 1, 2, -1]]),
    depths=torch.tensor([[1, 1, 2, 2, 3, 0]]),
    scores=torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0, float("-inf")]]),
    num_nodes=torch.tensor([5]),
)


@pytest.mark.parametrize("target,nodes,bonus", [
    # target token at columns [root, a, b, c, d, e, pad]
    ([5, 7, 1, 9, 1, 4, 0], [0, 2, 4], 4),     # root->a->c->e, bonus from e
    ([6, 1, 7, 1, 3, 1, 0], [1, 3], 3),        # root->b->d, bonus from d
    ([5, 2, 7, 1, 1, 1, 0], [0], 2),           # a accepted, c rejected (target says 2)
    ([8, 7, 7, 9, 1, 1, 0], [], 8),            # nothing accepted: bonus from the root
    ([0, 0, 0, 0, 0, 0, 0], [], 0),            # the padding slot (token 0) never matches
])
def test_golden_walks(target, nodes, bonus):
    res = walk(GOLDEN, torch.tensor([target]))
    assert res.num_accepted.tolist() == [len(nodes)]
    assert res.accepted_nodes[0, :len(nodes)].tolist() == nodes
    assert (res.accepted_nodes[0, len(nodes):] == -1).all()
    assert res.bonus_tokens.tolist() == [bonus]
    out = res.output_tokens(GOLDEN)[0].tolist()
    drafted = [GOLDEN.tokens[0, i].item() for i in nodes]
    assert out == drafted + [bonus] + [-1] * (6 - len(nodes))


def _brute_force_walk(tree: TreeBatch, r: int, target: list[int]) -> tuple[int, ...]:
    """Longest node path whose every token equals the target's token at its parent."""
    best: tuple[int, ...] = ()
    for i in range(int(tree.num_nodes[r])):
        chain, j = [], i
        while j >= 0:
            chain.append(j)
            j = int(tree.parents[r, j])
        chain.reverse()
        if all(int(tree.tokens[r, n]) == target[int(tree.parents[r, n]) + 1] for n in chain):
            best = max(best, tuple(chain), key=len)
    return best


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 4), st.integers(2, 5), st.integers(1, 30))
def test_greedy_walk_equals_brute_force(seed, num_req, vocab, budget):
    gen = torch.Generator().manual_seed(seed)
    depth = 4
    logits = torch.randn(num_req, depth, vocab, generator=gen, dtype=torch.float64)
    head = MarkovToyHead(torch.randn(depth, vocab, vocab, generator=gen, dtype=torch.float64))
    roots = torch.randint(0, vocab, (num_req,), generator=gen)
    tables = candidate_tables(logits, min(vocab, budget))
    tree = build_dartree(tables, head, tables.ids, roots, variant="pruned", budget=budget,
                         width=3, depth_bonus=-0.2)
    # a target that agrees with the drafter often: small vocabulary, random logits
    target_logits = torch.randn(num_req, 1 + budget, vocab, generator=gen)
    res = greedy_walk(tree, target_logits)
    target = target_logits.argmax(-1)
    for r in range(num_req):
        expected = _brute_force_walk(tree, r, target[r].tolist())
        assert tuple(res.accepted_nodes[r, :len(expected)].tolist()) == expected
        assert int(res.num_accepted[r]) == len(expected)
        last = expected[-1] + 1 if expected else 0
        assert int(res.bonus_tokens[r]) == int(target[r, last])


# --- sampled losslessness: a synthetic order-2 Markov target over a tiny vocabulary ---

VOCAB, HORIZON, DRAWS = 4, 3, 24_000


def _target_table(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 1.5 * torch.randn(VOCAB, VOCAB, VOCAB, generator=gen)   # logits of x | (a, b)


def _node_logits(table, tree, hist):
    """Target logits at [root] + nodes: the context's last two tokens index the table."""
    num_req, n = tree.tokens.shape
    tok_ext = torch.cat([hist[:, -1:], tree.tokens], dim=1)            # token at each column
    par_col = torch.cat([torch.full((num_req, 1), -1), tree.parents + 1], dim=1)
    prev = torch.where(par_col >= 0, torch.gather(tok_ext, 1, par_col.clamp(min=0)),
                       hist[:, -2:-1])
    return table[prev, tok_ext]                                        # [R, 1+N, V]


def _fixed_tree(num_req: int, tokens: list[int], parents: list[int]) -> TreeBatch:
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    t = lambda xs: torch.tensor([xs] * num_req)  # noqa: E731
    return TreeBatch(t(tokens), t(parents), t(depths), torch.zeros(num_req, len(tokens)),
                     torch.full((num_req,), len(tokens)))


def _last_two(out):
    """The last two tokens of prompt [1, 2] + the emitted tokens (-1 padded), per row."""
    length = (out >= 0).sum(1)
    ctx = torch.cat([torch.tensor([[1, 2]]).expand(out.shape[0], 2), out.clamp(min=0)], dim=1)
    return torch.gather(ctx, 1, length[:, None] + torch.arange(2))


def _decode(table, make_tree, temperature=1.0):
    """Rounds of sample-at-every-node + walk until HORIZON tokens are out, all rows at once."""
    out = torch.full((DRAWS, 0), -1, dtype=torch.long)
    round_no = 0
    while out.shape[1] < HORIZON or (out[:, :HORIZON] < 0).any():
        hist = _last_two(out)
        tree = make_tree(hist, round_no)
        res = sampled_walk(tree, _node_logits(table, tree, hist),
                           torch.full((DRAWS,), temperature))
        merged = torch.cat([out, res.output_tokens(tree)], dim=1)   # ragged rows, -1 padded
        order = torch.sort((merged < 0).long(), dim=1, stable=True).indices
        out = torch.gather(merged, 1, order)
        round_no += 1
    return out[:, :HORIZON]


def _exact_joint(table, temperature=1.0):
    probs = torch.zeros(VOCAB ** HORIZON, dtype=torch.float64)
    for idx, seq in enumerate(itertools.product(range(VOCAB), repeat=HORIZON)):
        ctx, p = [1, 2], 1.0
        for x in seq:
            p *= float(torch.softmax(table[ctx[-2], ctx[-1]].double() / temperature, 0)[x])
            ctx.append(x)
        probs[idx] = p
    return probs


def _chi_square_p(samples, probs):
    codes = (samples * torch.tensor([VOCAB ** 2, VOCAB, 1])).sum(1)
    counts = torch.bincount(codes, minlength=VOCAB ** HORIZON).double()
    return chisquare(counts.numpy(), (probs * DRAWS).numpy()).pvalue


def _mode_missing_tree(table):
    """Every node carries the least likely token after the prompt: the mode is never drafted."""
    worst = int(table[1, 2].argmin())
    return lambda hist, _: _fixed_tree(DRAWS, [worst, (worst + 1) % VOCAB, worst, worst],
                                       [-1, -1, 0, 2])


def _drafter_tree(seed):
    gen = torch.Generator().manual_seed(seed)
    head = MarkovToyHead(torch.randn(HORIZON, VOCAB, VOCAB, generator=gen))

    def make(hist, round_no):
        logits = 2 * torch.randn(DRAWS, HORIZON, VOCAB, generator=gen)
        tables = candidate_tables(logits, 3)
        return build_dartree(tables, head, tables.ids, hist[:, -1], variant="pruned", budget=6,
                             width=3, depth_bonus=-0.2)
    return make


@pytest.mark.parametrize("kind", ["drafter", "mode-missing", "chain-of-mode", "empty"])
def test_sampled_walk_is_lossless(kind):
    torch.manual_seed(1234)
    table = _target_table(5)
    if kind == "drafter":
        make = _drafter_tree(7)
    elif kind == "mode-missing":
        make = _mode_missing_tree(table)
    elif kind == "chain-of-mode":   # the greedy path of the target, as a chain of depth 3
        best = table[1, 2].argmax().item()
        nxt = table[2, best].argmax().item()
        make = lambda hist, _: _fixed_tree(DRAWS, [best, nxt, 0], [-1, 0, 1])  # noqa: E731
    else:                           # a zero-node tree: plain decoding through the bonus
        make = lambda hist, _: TreeBatch(  # noqa: E731
            torch.zeros(DRAWS, 1, dtype=torch.long), torch.full((DRAWS, 1), -1),
            torch.zeros(DRAWS, 1, dtype=torch.long), torch.full((DRAWS, 1), float("-inf")),
            torch.zeros(DRAWS, dtype=torch.long))
    samples = _decode(table, make)
    assert _chi_square_p(samples, _exact_joint(table)) > 1e-3


def test_sampled_walk_detects_a_biased_sampler():
    """The chi-square check has power: a sampler at the wrong temperature fails it."""
    torch.manual_seed(1234)
    table = _target_table(5)
    samples = _decode(table, _drafter_tree(7), temperature=0.6)
    assert _chi_square_p(samples, _exact_joint(table)) < 1e-6


def _filtered(logits, k, p):
    """Exact top-k then top-p distribution of one logits row (vLLM's order: the nucleus is
    taken over the top-k renormalised distribution)."""
    probs = torch.softmax(logits.double(), 0)
    order = torch.argsort(probs, descending=True).tolist()[:k]
    top_k_mass = float(probs[order].sum())
    keep, mass = [], 0.0
    for tok in order:
        if mass >= p:
            break
        keep.append(tok)
        mass += float(probs[tok]) / top_k_mass
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


@pytest.mark.parametrize("k,p", [(0, 1.0), (3, 1.0), (0, 0.6), (4, 0.8)])
def test_sample_target_tokens_follows_top_k_top_p(k, p):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, generator=gen)
    n = 20_000
    tokens = sample_target_tokens(logits.expand(n, 1, 8), torch.ones(n),
                                  torch.full((n,), k), torch.full((n,), p),
                                  generators=None)[:, 0]
    expected = _filtered(logits, k if k > 0 else 8, p)
    counts = torch.bincount(tokens, minlength=8).double()
    support = expected > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), (expected[support] * n).numpy()).pvalue > 1e-3


def test_per_request_generators_are_reproducible_and_greedy_rows_are_argmax():
    logits = torch.randn(3, 5, 11)
    temps = torch.tensor([1.0, 0.0, 0.8])
    draw = lambda: sample_target_tokens(  # noqa: E731
        logits, temps, generators=[torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    a, b = draw(), draw()
    assert torch.equal(a, b)
    assert torch.equal(a[1], logits[1].argmax(-1))


def test_walk_uses_the_given_mask():
    """Passing a precomputed mask gives the same result as letting walk build one."""
    from vllm_dartree.tree import ancestor_mask
    target = torch.tensor([[5, 7, 1, 9, 1, 4, 0]])
    a = walk(GOLDEN, target)
    b = walk(GOLDEN, target, ancestor_mask(GOLDEN.parents))
    assert torch.equal(a.accepted_nodes, b.accepted_nodes)
    assert path_of(GOLDEN, 0, int(a.accepted_nodes[0, 2])) == (5, 7, 9)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), num_req=st.integers(1, 4), n=st.integers(1, 40),
       chain=st.floats(0, 1))
def test_walk_without_a_mask_equals_brute_force_on_deep_trees(seed, num_req, n, chain):
    """The walk's pointer jumping (no mask) against the brute force and against the walk
    with the ancestor mask, on random trees up to 40 deep (`chain`: how often a node hangs
    under the node just before it), with slots past each tree's size."""
    from vllm_dartree.tree import TreeBatch, ancestor_mask
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((num_req, n), -1, dtype=torch.long)
    depths = torch.zeros(num_req, n, dtype=torch.long)
    for r in range(num_req):
        for i in range(n):
            deep = torch.rand((), generator=gen) < chain
            p = i - 1 if deep else int(torch.randint(-1, i, (), generator=gen))
            parents[r, i] = p
            depths[r, i] = 1 + (int(depths[r, p]) if p >= 0 else 0)
    tokens = torch.zeros(num_req, n, dtype=torch.long)   # siblings' tokens are distinct:
    for r in range(num_req):                               # a node's is its sibling rank
        for i in range(n):
            tokens[r, i] = int((parents[r, :i] == parents[r, i]).sum())
    counts = torch.randint(0, n + 1, (num_req,), generator=gen)
    tree = TreeBatch(tokens, parents, depths, torch.zeros(num_req, n), counts)
    target = torch.randint(0, 2, (num_req, 1 + n), generator=gen)   # ranks 0 and 1 match
    res = walk(tree, target)
    masked = walk(tree, target, ancestor_mask(parents))
    assert torch.equal(res.accepted_nodes, masked.accepted_nodes)
    assert torch.equal(res.bonus_tokens, masked.bonus_tokens)
    for r in range(num_req):
        sized = TreeBatch(tokens[r:r + 1, :int(counts[r])], parents[r:r + 1, :int(counts[r])],
                          depths[r:r + 1, :int(counts[r])], torch.zeros(1, int(counts[r])),
                          counts[r:r + 1])
        expected = _brute_force_walk(sized, 0, target[r].tolist())
        assert int(res.num_accepted[r]) == len(expected)
        assert tuple(res.accepted_nodes[r, :len(expected)].tolist()) == expected
