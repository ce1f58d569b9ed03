"""Masks, bitmasks, positions and truncation of flattened trees."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import random_parents, row_copy_mask
from vllm_dartree.tree import (
    TreeBatch,
    ancestor_bitmask,
    ancestor_mask,
    bitmask_to_mask,
    mask_to_bitmask,
    tree_positions,
    truncate,
)

# root ─ a(0) ─ c(2) ─ e(4)
#      └ b(1) ─ d(3)
GOLDEN_PARENTS = torch.tensor([[-1, -1, 0, 1, 2]])
GOLDEN_MASK = torch.tensor([
    # r  a  b  c  d  e
    [1, 0, 0, 0, 0, 0],  # root
    [1, 1, 0, 0, 0, 0],  # a
    [1, 0, 1, 0, 0, 0],  # b
    [1, 1, 0, 1, 0, 0],  # c
    [1, 0, 1, 0, 1, 0],  # d
    [1, 1, 0, 1, 0, 1],  # e
], dtype=torch.bool)


def _golden_tree() -> TreeBatch:
    return TreeBatch(
        tokens=torch.tensor([[11, 12, 13, 14, 15]]),
        parents=GOLDEN_PARENTS,
        depths=torch.tensor([[1, 1, 2, 2, 3]]),
        scores=torch.tensor([[-0.1, -0.2, -0.3, -0.4, -0.5]]),
        num_nodes=torch.tensor([5]),
    )


def test_golden_mask_and_bitmask():
    assert torch.equal(ancestor_mask(GOLDEN_PARENTS)[0], GOLDEN_MASK)
    bits = ancestor_bitmask(GOLDEN_PARENTS)
    assert bits.shape == (1, 6, 1) and bits.dtype == torch.int32
    assert bits[0, :, 0].tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10101, 0b101011]


def test_golden_positions():
    pos = tree_positions(_golden_tree(), torch.tensor([100]))
    assert pos.tolist() == [[100, 101, 101, 102, 102, 103]]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 140), st.integers(0, 2**31))
def test_mask_rows_are_ancestors_plus_self(num_req, n, seed):
    parents = random_parents(num_req, n, torch.Generator().manual_seed(seed))
    mask = ancestor_mask(parents)
    for r in range(num_req):
        assert torch.equal(mask[r], row_copy_mask(parents[r].tolist()))
    assert torch.equal(bitmask_to_mask(ancestor_bitmask(parents), 1 + n), mask)


def test_bitmask_sign_bit_round_trip():
    mask = torch.zeros(1, 70, dtype=torch.bool)
    mask[0, [0, 31, 32, 63, 64, 69]] = True
    bits = mask_to_bitmask(mask)
    assert bits.shape == (1, 3)
    assert bits[0, 0] < 0 and bits[0, 1] < 0  # bit 31 set in words 0 and 1
    assert torch.equal(bitmask_to_mask(bits, 70), mask)


def test_truncate_keeps_a_valid_prefix():
    tree = _golden_tree()
    cut = truncate(tree, torch.tensor([3]))
    assert cut.num_nodes.tolist() == [3]
    assert cut.tokens.tolist() == [[11, 12, 13, 0, 0]]
    assert cut.parents.tolist() == [[-1, -1, 0, -1, -1]]
    assert cut.depths.tolist() == [[1, 1, 2, 0, 0]]
    assert cut.scores[0, 3:].eq(float("-inf")).all()
    # an int bound, larger than the tree, changes nothing
    same = truncate(tree, 10)
    assert torch.equal(same.tokens, tree.tokens) and same.num_nodes.tolist() == [5]
