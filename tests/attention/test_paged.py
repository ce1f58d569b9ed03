"""Paged tree attention: branch by branch against plain causal attention; mixed batches
against dense per-request attention; KV compaction."""

import pytest
import torch

from tests.helpers import random_parents
from vllm_dartree.attention import (
    PagedBatch,
    copy_kv_slots,
    paged_attention_reference,
    slots_of,
    write_kv,
)
from vllm_dartree.tree import ancestor_bitmask

NH, KVH, D = 4, 2, 16


class _Cache:
    """A paged cache with shuffled physical blocks, plus a dense copy of every sequence."""

    def __init__(self, seq_lens, block_size, gen):
        per_req = [(n + block_size - 1) // block_size for n in seq_lens]
        self.block_size = block_size
        perm = torch.randperm(sum(per_req) + 3, generator=gen)             # spare blocks too
        self.k = torch.full((len(perm), block_size, KVH, D), float("nan"))
        self.v = torch.full_like(self.k, float("nan"))
        width = max(per_req)
        self.table = torch.zeros(len(seq_lens), width, dtype=torch.long)
        used = 0
        for r, nb in enumerate(per_req):
            self.table[r, :nb] = perm[used:used + nb]
            used += nb
        self.dense = []
        for r, n in enumerate(seq_lens):
            k, v = torch.randn(n, KVH, D, generator=gen), torch.randn(n, KVH, D, generator=gen)
            write_kv(self.k, self.v, k, v, slots_of(self.table[r], torch.arange(n), block_size))
            self.dense.append((k, v))


def _batch(q_lens, seq_lens, table, trees):
    qmax = max(q_lens)
    words = (qmax + 31) // 32
    mask = torch.zeros(len(q_lens), qmax, words, dtype=torch.int32)
    for r, parents in trees.items():
        bits = ancestor_bitmask(parents)[0]                                  # [1+N, w]
        mask[r, :bits.shape[0], :bits.shape[1]] = bits
    return PagedBatch(
        query_start_loc=torch.tensor([0] + q_lens).cumsum(0),
        seq_lens=torch.tensor(seq_lens), block_table=table,
        is_tree=torch.tensor([r in trees for r in range(len(q_lens))]), tree_mask=mask)


def _plain(q_row, k, v):
    """One query row attending to every given key (no mask at all)."""
    group = NH // KVH
    return torch.nn.functional.scaled_dot_product_attention(
        q_row[:, None], k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), scale=D ** -0.5)[:, 0]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("n,context", [(1, 5), (12, 0), (40, 37)])
def test_tree_rows_equal_causal_attention_along_each_branch(block_size, n, context):
    gen = torch.Generator().manual_seed(n * 100 + block_size + context)
    parents = random_parents(1, n, gen)
    q_len = 1 + n
    cache = _Cache([context + q_len], block_size, gen)
    q = torch.randn(q_len, NH, D, generator=gen)
    out = paged_attention_reference(q, cache.k, cache.v,
                                    _batch([q_len], [context + q_len], cache.table, {0: parents}),
                                    D ** -0.5)
    k, v = cache.dense[0]
    for col in range(q_len):                     # column 0 = root, column i + 1 = node i
        path, i = [], col - 1
        while i >= 0:
            path.append(i + 1)
            i = int(parents[0, i])
        path = list(range(context)) + [context] + [context + c for c in reversed(path)]
        expected = _plain(q[col], k[path], v[path])
        torch.testing.assert_close(out[col], expected, rtol=1e-5, atol=1e-5)


def test_mixed_batch_of_prefill_decode_and_tree_rows():
    gen = torch.Generator().manual_seed(7)
    q_lens, seq_lens = [6, 1, 9, 3], [6, 20, 30, 11]   # prefill, decode, tree, chunked prefill
    parents = random_parents(1, 8, gen)
    cache = _Cache(seq_lens, 4, gen)
    q = torch.randn(sum(q_lens), NH, D, generator=gen)
    out = paged_attention_reference(q, cache.k, cache.v,
                                    _batch(q_lens, seq_lens, cache.table, {2: parents}), D ** -0.5)
    start = 0
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        k, v = cache.dense[r]
        for i in range(q_len):
            pos = seq_len - q_len + i
            if r == 2:   # tree: context + root + ancestors of the row
                cols, j = [], i - 1
                while j >= 0:
                    cols.append(j + 1)
                    j = int(parents[0, j])
                keys = list(range(seq_len - q_len)) + [seq_len - q_len] + \
                    [seq_len - q_len + c for c in reversed(cols)]
            else:        # causal
                keys = list(range(pos + 1))
            torch.testing.assert_close(out[start + i], _plain(q[start + i], k[keys], v[keys]),
                                       rtol=1e-5, atol=1e-5)
        start += q_len


def test_copy_kv_slots_moves_the_accepted_path_into_chain_slots():
    gen = torch.Generator().manual_seed(3)
    context, n, block_size = 13, 10, 4
    cache = _Cache([context + 1 + n], block_size, gen)
    k, v = cache.dense[0]
    accepted = torch.tensor([1, 4, 5, 9])                   # node indices, root to leaf
    src = slots_of(cache.table[0], context + 1 + accepted, block_size)
    dst = slots_of(cache.table[0], context + 1 + torch.arange(len(accepted)), block_size)
    copy_kv_slots(cache.k, cache.v, src, dst)
    pos = torch.arange(context + 1 + len(accepted))
    slots = slots_of(cache.table[0], pos, block_size)
    got_k = cache.k.view(-1, KVH, D)[slots]
    got_v = cache.v.view(-1, KVH, D)[slots]
    keep = torch.cat([torch.arange(context + 1), context + 1 + accepted])
    torch.testing.assert_close(got_k, k[keep])
    torch.testing.assert_close(got_v, v[keep])
