"""CPU serving's packed weights (`pack_for_cpu`: vLLM's oneDNN matmul) against torch's."""

import pytest
import torch

from vllm_dartree.drafter import ContextCache
from vllm_dartree.drafter.layers import linear
from vllm_dartree.engine.drafters import _pack_linears, pack_for_cpu


def _packed(weight: torch.Tensor) -> torch.Tensor:
    if not pack_for_cpu([weight]):
        pytest.skip("vLLM's CPU oneDNN ops are not installed here")
    return weight


@pytest.mark.parametrize("rows", [1, 2, 3, 12, 48, 130])
def test_packed_linear_equals_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 96, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    want = x @ weight.T
    _packed(weight)
    got = linear(x, weight)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # leading dimensions and a non-contiguous input (a transposed view)
    x3 = torch.randn(4, 96, rows, generator=gen).transpose(1, 2)
    torch.testing.assert_close(linear(x3, weight), x3 @ weight.T, rtol=1e-5, atol=1e-4)


def test_packed_linear_bfloat16():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 32, generator=gen)
    _packed(weight)
    want = (x.to(torch.bfloat16).float() @ weight.float().T)
    torch.testing.assert_close(linear(x, weight).float(), want, rtol=2e-2, atol=5e-2)


def test_autograd_and_new_tensors_take_torch_path():
    """Training never goes through a packed copy: an input that needs gradients (with grad
    mode on) gets torch's matmul and its gradient; a tensor made from the weight (`.to`, a
    slice) carries no handle."""
    weight = torch.randn(40, 16, requires_grad=True)
    _packed(weight)
    x = torch.randn(3, 16, requires_grad=True)
    linear(x, weight).sum().backward()
    torch.testing.assert_close(x.grad, weight.detach().sum(0).expand(3, -1))
    assert weight.grad is not None
    assert getattr(weight.detach().clone(), "_dt_packed", None) is None
    assert getattr(weight[:, :8], "_dt_packed", None) is None


def test_packed_drafter_drafts_what_the_unpacked_one_does(tiny_target, drafter_folders):
    """The engine packs a CPU drafter's matrices once (`_pack_linears`); its pass gives the
    unpacked drafter's logits and hidden states (another summation order: close, not equal)."""
    plain = tiny_target.load(drafter_folders["domino"])
    packed = tiny_target.load(drafter_folders["domino"])
    if not _pack_linears(packed):
        pytest.skip("vLLM's CPU oneDNN ops are not installed here")
    gen = torch.Generator().manual_seed(0)
    width = len(plain.spec.target_layer_ids) * plain.spec.hidden_size
    feats = [torch.randn(9, width, generator=gen), torch.randn(4, width, generator=gen)]
    roots = torch.tensor([5, 17])
    outs = []
    for drafter in (plain, packed):
        cache = ContextCache()
        with torch.no_grad():
            drafter.backbone.extend_context(cache, ["a", "b"], feats)
            outs.append(drafter.backbone(cache, ["a", "b"], roots))
    torch.testing.assert_close(outs[1].base_logits, outs[0].base_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[1].hidden, outs[0].hidden, rtol=1e-4, atol=1e-4)
