"""csrc_triton.dartree_step against tree.select's torch reference, under TRITON_INTERPRET=1."""

import pytest
import torch

from vllm_dartree.csrc_triton.dartree_step import fits, score_and_select_triton
from vllm_dartree.tree.select import score_and_select_reference


def _check(logits, parents, norm, quota):
    got = score_and_select_triton(logits, parents, norm, quota)
    ref = score_and_select_reference(logits, parents, norm, quota)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])


@pytest.mark.parametrize("num_req", [1, 4])
@pytest.mark.parametrize("budget", [1, 16, 64, 128])
@pytest.mark.parametrize("corrected", [True, False])
def test_step_matches_reference(num_req, budget, corrected):
    """Shapes of DARTree (P = W parents, K = min(64, B)) and of DDTree's beam (P = K = B)."""
    gen = torch.Generator().manual_seed(budget + num_req)
    for parents_n, k, quota in [(min(12, budget), min(64, budget), min(12, budget)),
                                (1, min(64, budget), min(12, budget)),
                                (min(budget, 64), min(budget, 64), budget)]:
        logits = 3 * torch.randn(num_req, parents_n, k, generator=gen)
        parents = -torch.rand(num_req, parents_n, generator=gen) * 5
        norm = None if corrected else torch.logsumexp(logits[:, 0], -1) + 2.0
        if not corrected:   # uncorrected depths share one row of logits across parents
            logits = logits[:, :1].expand(num_req, parents_n, k)
        _check(logits, parents, norm, min(quota, parents_n * k))


def test_dead_parents_and_ragged_sizes():
    """-inf parents (padding) never beat live ones; non-power-of-two P and K."""
    logits = torch.randn(3, 5, 7)
    parents = torch.tensor([[0.0, -1.0, float("-inf"), -0.5, float("-inf")]] * 3)
    got = score_and_select_triton(logits, parents, None, 20)
    ref = score_and_select_reference(logits, parents, None, 20)
    live = ref[0].isfinite()
    assert live.sum(1).tolist() == [20, 20, 20]      # 3 live parents x 7 children >= 20
    torch.testing.assert_close(got[0], ref[0])
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    assert not (got[1] == 2).any() and not (got[1] == 4).any()


def test_limits_and_errors():
    assert fits(torch.empty(1, 64, 64), 64) and not fits(torch.empty(1, 256, 128), 64)
    with pytest.raises(ValueError, match="quota"):
        score_and_select_triton(torch.randn(1, 2, 3), torch.zeros(1, 2), None, 7)
    with pytest.raises(ValueError, match="parent_scores"):
        score_and_select_triton(torch.randn(1, 2, 3), torch.zeros(1, 3), None, 2)
