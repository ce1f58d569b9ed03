"""The dispatch point: torch references on CPU, Triton only for CUDA tensors."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dartree import ops
from vllm_dartree.tree import ancestor_mask


def test_cpu_tensors_use_the_references(monkeypatch):
    parents = torch.tensor([[-1, 0, 0, 1]])
    assert not ops.use_triton(parents)
    assert torch.equal(ops.ancestor_mask(parents), ancestor_mask(parents))
    scores, pos, rank = ops.score_and_select(torch.randn(2, 3, 4), torch.zeros(2, 3), None, 5)
    assert scores.shape == pos.shape == rank.shape == (2, 5)
    assert (scores[:, :-1] >= scores[:, 1:]).all()


def test_cuda_path_routes_to_the_kernels(monkeypatch):
    """Pretend the tensor is on CUDA: the call must reach csrc_triton, which the interpreter
    runs on CPU; results equal the reference."""
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    parents = torch.tensor([[-1, 0, 1, -1, 3]])
    assert torch.equal(ops.ancestor_mask(parents), ancestor_mask(parents))
    assert torch.equal(ops.ancestor_bitmask(parents)[0, :, 0],
                       torch.tensor([1, 3, 7, 15, 17, 49], dtype=torch.int32))
    logits, par = torch.randn(2, 3, 4), torch.zeros(2, 3)
    got = ops.score_and_select(logits, par, None, 5)
    ref = ops.score_and_select_reference(logits, par, None, 5)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])


def test_paged_attention_routes_to_the_kernel(monkeypatch):
    from vllm_dartree.attention import PagedBatch, paged_attention_reference
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(4, 4, 2, 16, generator=gen)
    v = torch.randn(4, 4, 2, 16, generator=gen)
    q = torch.randn(3, 4, 16, generator=gen)
    batch = PagedBatch(torch.tensor([0, 3]), torch.tensor([9]), torch.tensor([[2, 0, 3]]),
                       torch.tensor([True]),
                       ops.ancestor_bitmask(torch.tensor([[-1, -1]])))
    ref = paged_attention_reference(q, k, v, batch, 0.25)
    assert torch.equal(ops.paged_attention(q, k, v, batch, 0.25, 3), ref)
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    torch.testing.assert_close(ops.paged_attention(q, k, v, batch, 0.25, 3), ref)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), vocab=st.integers(1, 300),
       levels=st.integers(1, 4), nans=st.booleans(), dtype=st.sampled_from(
           [torch.float32, torch.bfloat16, torch.float64]))
def test_argmax_is_torch_argmax_with_ties_and_nans(seed, rows, vocab, levels, nans, dtype):
    """`ops.argmax` (vLLM's kernel or max(dim).indices on the CPU) against `argmax(dim=-1)`,
    whose first maximum greedy decoding follows: few distinct values (ties everywhere), NaNs,
    -inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, 2, vocab), generator=gen).to(dtype)
    x[torch.rand(x.shape, generator=gen) < 0.1] = float("-inf")
    if nans:
        x[torch.rand(x.shape, generator=gen) < 0.05] = float("nan")
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))
    flat = x.reshape(-1, vocab)            # 2-D: vLLM's CPU kernel where it is installed
    assert torch.equal(ops.argmax(flat), flat.argmax(dim=-1))
    assert torch.equal(ops.argmax(flat[::2]), flat[::2].argmax(dim=-1))   # a strided view
