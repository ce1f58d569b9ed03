"""csrc_triton.tree_attention against the torch reference, under TRITON_INTERPRET=1:
mixed batches of prefill, decode and tree rows, ragged contexts, block sizes, GQA ratios."""

import pytest
import torch

from tests.helpers import random_parents
from vllm_dartree.attention import PagedBatch, paged_attention_reference, slots_of, write_kv
from vllm_dartree.csrc_triton.tree_attention import tree_attention
from vllm_dartree.tree import ancestor_bitmask


def _inputs(q_lens, seq_lens, trees, block_size, heads, kv_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    per_req = [(n + block_size - 1) // block_size for n in seq_lens]
    perm = torch.randperm(sum(per_req) + 2, generator=gen)
    k_cache = torch.randn(len(perm), block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(len(perm), block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.zeros(len(seq_lens), max(per_req), dtype=torch.long)
    used = 0
    for r, nb in enumerate(per_req):
        table[r, :nb] = perm[used:used + nb]
        used += nb
    for r, n in enumerate(seq_lens):   # fresh values in every used slot
        write_kv(k_cache, v_cache, torch.randn(n, kv_heads, head_dim, generator=gen),
                 torch.randn(n, kv_heads, head_dim, generator=gen),
                 slots_of(table[r], torch.arange(n), block_size))
    qmax = max(q_lens)
    mask = torch.zeros(len(q_lens), qmax, (qmax + 31) // 32, dtype=torch.int32)
    for r, parents in trees.items():
        bits = ancestor_bitmask(parents)[0]
        mask[r, :bits.shape[0], :bits.shape[1]] = bits
    batch = PagedBatch(torch.tensor([0] + q_lens).cumsum(0), torch.tensor(seq_lens), table,
                       torch.tensor([r in trees for r in range(len(q_lens))]), mask)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, batch


def _parents(n, seed):
    return random_parents(1, n, torch.Generator().manual_seed(seed))


def _run(q, k, v, batch, scale, **kwargs):
    return tree_attention(q, k, v, batch.query_start_loc, batch.seq_lens, batch.block_table,
                          batch.is_tree, batch.tree_mask, scale,
                          int(batch.query_start_loc.diff().max()), **kwargs)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 2)])
@pytest.mark.parametrize("splits", [None, 3])
def test_mixed_batch_matches_reference(block_size, heads, kv_heads, splits):
    """Groups of 1, 2, 4 and 3 (padded to 4) query heads per KV head; the keys in one slice
    or split in three (flash-decoding merge), slices shorter than a tile and empty ones."""
    # rows: prefill chunk (no context), decode row, 17-row tree, chunked prefill, 65-row tree
    q_lens = [7, 1, 17, 5, 65]
    seq_lens = [7, 40, 17 + 23, 5 + 9, 65 + 3]
    trees = {2: _parents(16, 1), 4: _parents(64, 2)}
    q, k, v, batch = _inputs(q_lens, seq_lens, trees, block_size, heads, kv_heads, 16,
                             torch.float32, seed=block_size * heads + kv_heads)
    got = _run(q, k, v, batch, 0.25, num_splits=splits, block_n=16)
    ref = paged_attention_reference(q, k, v, batch, 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [1, 4])
def test_long_context_padding_rows_and_a_strided_out(splits):
    """Contexts of many tiles; padding tokens after the last request (CUDA-graph batches)
    are left alone, with one slice or several; `out` with its own strides."""
    q_lens, seq_lens = [1, 40, 3], [300, 40 + 200, 3 + 150]
    q, k, v, batch = _inputs(q_lens, seq_lens, {1: _parents(39, 7)}, 16, 8, 2, 32,
                             torch.float32, seed=11)
    q = torch.cat([q, torch.randn(5, 8, 32)])                  # 5 padding tokens
    wide = torch.full((q.shape[0], 8, 48), 7.0)
    out = wide[:, :, 8:40]                                     # strides differ from q's
    got = _run(q, k, v, batch, 32 ** -0.5, out=out, num_splits=splits, block_n=32)
    torch.testing.assert_close(got, out)     # written in place
    ref = paged_attention_reference(q[:44], k, v, batch, 32 ** -0.5)
    torch.testing.assert_close(out[:44], ref, rtol=1e-4, atol=1e-4)
    assert torch.all(wide[:, :, :8] == 7.0) and torch.all(wide[:, :, 40:] == 7.0)
    assert torch.all(out[44:] == 7.0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
def test_head_sizes_and_dtypes(head_dim, dtype, tol):
    q_lens, seq_lens = [1, 33], [50, 33 + 100]
    q, k, v, batch = _inputs(q_lens, seq_lens, {1: _parents(32, 5)}, 16, 4, 2, head_dim, dtype,
                             seed=head_dim)
    got = _run(q, k, v, batch, head_dim ** -0.5)
    ref = paged_attention_reference(q, k, v, batch, head_dim ** -0.5)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_bad_shapes_are_refused():
    q = torch.zeros(3, 4, 16)
    cache = torch.zeros(2, 4, 3, 16)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q, cache, cache, torch.tensor([0, 3]), torch.tensor([3]),
                       torch.zeros(1, 1, dtype=torch.long), torch.tensor([False]),
                       torch.zeros(1, 3, 1, dtype=torch.int32), 1.0, 3)
