"""csrc_triton.tree_mask against its torch reference, under TRITON_INTERPRET=1."""

import pytest
import torch

from tests.helpers import random_parents, row_copy_mask
from vllm_dartree.csrc_triton.tree_mask import tree_ancestor_bitmask, tree_ancestor_mask
from vllm_dartree.tree import ancestor_bitmask, ancestor_mask


def _parents(num_req, n, seed, shape):
    if shape == "chain":
        return torch.arange(-1, n - 1).expand(num_req, -1).clone()
    if shape == "star":
        return torch.full((num_req, n), -1, dtype=torch.long)
    return random_parents(num_req, n, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_req", [1, 4])
@pytest.mark.parametrize("n", [1, 16, 64, 128])
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
def test_mask_kernel_matches_reference(num_req, n, shape):
    parents = _parents(num_req, n, seed=n + num_req, shape=shape)
    got = tree_ancestor_mask(parents)
    assert got.shape == (num_req, 1 + n, 1 + n) and got.dtype == torch.bool
    assert set(got.view(torch.int8).unique().tolist()) <= {0, 1}
    assert torch.equal(got, ancestor_mask(parents))
    for r in range(num_req):    # each row: exactly the ancestors plus self
        assert torch.equal(got[r], row_copy_mask(parents[r].tolist()))


@pytest.mark.parametrize("num_req", [1, 4])
@pytest.mark.parametrize("n", [1, 16, 31, 64, 128])
def test_bitmask_kernel_matches_reference(num_req, n):
    parents = _parents(num_req, n, seed=7 * n + num_req, shape="random")
    got = tree_ancestor_bitmask(parents)
    assert got.dtype == torch.int32 and got.shape == (num_req, 1 + n, (n + 32) // 32)
    assert torch.equal(got, ancestor_bitmask(parents))


def test_depth_bound_and_int32_parents():
    """max_depth bounds the hops; a bound at the true depth gives the full mask."""
    parents = _parents(2, 40, 0, "chain")
    assert torch.equal(tree_ancestor_mask(parents.int(), max_depth=40), ancestor_mask(parents))
    short = tree_ancestor_mask(parents, max_depth=3)
    assert torch.equal(short, ancestor_mask(parents, max_depth=3))
    assert not short[0, 40, 1]    # node 39 is 39 levels deep: its far ancestors were not reached


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="parents"):
        tree_ancestor_mask(torch.zeros(3, dtype=torch.long))
