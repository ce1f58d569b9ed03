"""GraphedTreeBuilder: bucketed static-shape rounds give exactly build_tree's trees.

On CPU the bucket path pads eagerly (`pad=True`): the same static buffers, stale padding
rows and output slicing that a CUDA-graph replay uses, so this checks everything but the
capture itself (which examples/gpu_check.py does on a GPU, against eager).
"""

import pytest
import torch

from tests.helpers import assert_valid_tree
from vllm_dartree import DARTreeConfig
from vllm_dartree.drafter import DominoGRUHead
from vllm_dartree.tree import MarkovToyHead, ancestor_bitmask, build_tree
from vllm_dartree.tree.graphs import GraphedTreeBuilder

D, V, H = 6, 50, 8
CONFIGS = [
    DARTreeConfig(budget=16, width=4, topk=8),
    DARTreeConfig(variant="fixed", budget=16, topk=8),
    DARTreeConfig(builder="ddtree", budget=16, topk=8),
    DARTreeConfig(builder="chain", topk=8),
]


def _head(kind, gen):
    if kind == "gru":
        return DominoGRUHead(H, 6, 5, V, torch.randn(V, H, generator=gen))
    return MarkovToyHead(torch.randn(D, V, V, generator=gen))


def _round(r, gen):
    return (torch.randn(r, D, V, generator=gen), torch.randn(r, D, H, generator=gen),
            torch.randint(0, V, (r,), generator=gen))


def _assert_same(a, b):
    for name in ("tokens", "parents", "depths", "num_nodes"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.scores, b.scores)


@pytest.mark.parametrize("kind", ["gru", "markov"])
@pytest.mark.parametrize("config", CONFIGS, ids=["pruned", "fixed", "ddtree", "chain"])
def test_bucketed_rounds_equal_build_tree(kind, config):
    gen = torch.Generator().manual_seed(5)
    head = _head(kind, gen)
    builder = GraphedTreeBuilder(config, head, buckets=(1, 4, 8), use_graphs=False, pad=True,
                                 with_mask=True)
    # several rounds through the same buckets: stale padding rows must not matter
    for r in (3, 1, 4, 2, 7, 3):
        logits, hidden, roots = _round(r, gen)
        with torch.no_grad():
            want = build_tree(config, logits, hidden, roots, head)
        got, mask = builder(logits, hidden, roots)
        _assert_same(got, want)
        assert torch.equal(mask, ancestor_bitmask(want.parents))
        assert_valid_tree(got, budget=config.budget)
    assert len(builder._captured) == 3    # buckets 4, 1, 8 each set up once


def test_above_the_largest_bucket_runs_eagerly():
    gen = torch.Generator().manual_seed(6)
    config = CONFIGS[0]
    head = _head("markov", gen)
    builder = GraphedTreeBuilder(config, head, buckets=(1, 2), use_graphs=False, pad=True)
    logits, hidden, roots = _round(5, gen)
    got, mask = builder(logits, hidden, roots)
    _assert_same(got, build_tree(config, logits, hidden, roots, head))
    assert mask is None and not builder._captured
    assert builder.bucket(2) == 2 and builder.bucket(3) is None


def test_cpu_defaults_to_plain_build_tree_and_refuses_graphs():
    gen = torch.Generator().manual_seed(7)
    config = CONFIGS[0]
    builder = GraphedTreeBuilder(config, _head("gru", gen))
    logits, hidden, roots = _round(2, gen)
    builder(logits, hidden, roots)
    assert not builder._captured and builder.replays == 0
    with pytest.raises(ValueError, match="CUDA"):
        GraphedTreeBuilder(config, None, use_graphs=True)(logits, hidden, roots)
    with pytest.raises(ValueError, match="increasing"):
        GraphedTreeBuilder(config, None, buckets=(4, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager():
    gen = torch.Generator().manual_seed(8)
    config = CONFIGS[0]
    head = _head("gru", gen).cuda()
    builder = GraphedTreeBuilder(config, head, buckets=(4,), with_mask=True)
    for r in (3, 4, 2):
        logits, hidden, roots = (t.cuda() for t in _round(r, gen))
        got, _ = builder(logits, hidden, roots)
        with torch.no_grad():
            _assert_same(got, build_tree(config, logits, hidden, roots, head))
    assert builder.replays == 3


@pytest.mark.parametrize("config", CONFIGS[:3], ids=["pruned", "fixed", "ddtree"])
def test_graphed_round_walk_equals_the_brute_force_walk(config):
    """A whole device round on bucketed static shapes: construction, the bitmask built in the
    same replay, the greedy walk on it; accepted paths equal a brute-force oracle's."""
    from tests.tree.test_verify import _brute_force_walk
    from vllm_dartree.tree import bitmask_to_mask, greedy_walk

    gen = torch.Generator().manual_seed(9)
    head = _head("gru", gen)
    builder = GraphedTreeBuilder(config, head, buckets=(8,), use_graphs=False, pad=True,
                                 with_mask=True)
    logits, hidden, roots = _round(5, gen)
    tree, bits = builder(logits, hidden, roots)
    n = tree.max_nodes
    mask = torch.stack([bitmask_to_mask(bits[r], 1 + n) for r in range(5)])
    # a target that agrees with the drafter's best path for a few depths, then not
    target_logits = torch.randn(5, 1 + n, V, generator=gen)
    for r in range(5):
        i = 0
        for node in range(n):
            if int(tree.parents[r, node]) == i - 1 and int(tree.depths[r, node]) <= 3:
                target_logits[r, i, tree.tokens[r, node]] += 100.0
                i = node + 1
    result = greedy_walk(tree, target_logits, mask)
    targets = target_logits.argmax(-1)
    for r in range(5):
        want = _brute_force_walk(tree, r, targets[r].tolist())
        got = tuple(result.accepted_nodes[r, :int(result.num_accepted[r])].tolist())
        assert got == want
    # the walk went as deep as the trees allow (up to the 3 depths the target agrees on)
    assert int(result.num_accepted.max()) >= min(2, int(tree.depths.max()))
