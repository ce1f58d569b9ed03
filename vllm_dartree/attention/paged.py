"""Paged attention for mixed batches with tree masks, KV writes and KV compaction (pure torch).

The torch reference of the GPU tree-attention kernel to come and the math of the CPU backend.
Layout (vLLM's words): the KV cache is `[num_blocks, block_size, num_kv_heads, head_size]` per
K and V; token position p of request r lives in slot `block_table[r, p // block_size] *
block_size + p % block_size`. Query rows are flattened over requests (`query_start_loc`).

Request r's q_len rows are the last q_len positions of its sequence (`seq_lens[r]` includes
them): row i sees every earlier position (the committed context) and, inside this window of
q_len columns, either the causal triangle (prefill chunks, decode rows) or its tree-mask row
(`is_tree[r]`): for a verify request `[root] + nodes` that is the ancestor mask of the tree.

Worked example, R = 2: a decode row for request a, a 3-row tree for request b:

    query_start_loc = [0, 1, 4]   rows: [a0 | b0 b1 b2]
    seq_lens        = [10, 7]     a0 at position 9; b rows at positions 4, 5, 6 (slots)
    is_tree         = [F, T]      b: root(b0) ─ b1, root ─ b2  ->  row b2 sees b0 and b2 only
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dartree.tree.structure import bitmask_to_mask

__all__ = ["PagedBatch", "paged_attention_reference", "slots_of", "write_kv", "copy_kv_slots"]


@dataclass(frozen=True, slots=True)
class PagedBatch:
    query_start_loc: torch.Tensor  # [R + 1] int64, rows of request r: [qsl[r], qsl[r + 1])
    seq_lens: torch.Tensor         # [R] int64, KV length of request r, this step's rows included
    block_table: torch.Tensor      # [R, max_blocks] int64, physical block of each logical block
    is_tree: torch.Tensor          # [R] bool, rows use tree_mask (else causal)
    tree_mask: torch.Tensor        # [R, Qmax, ceil(Qmax / 32)] int32 window bitmask per row


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slots of `positions` ([R, T] or [T] with a [max_blocks] table row)."""
    blocks = torch.gather(block_table, -1, positions // block_size)
    return blocks * block_size + positions % block_size


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, KVH, D] at slot_mapping [T] (vLLM's reshape_and_cache, plain layout)."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def copy_kv_slots(k_cache: torch.Tensor, v_cache: torch.Tensor, src_slots: torch.Tensor,
                  dst_slots: torch.Tensor) -> None:
    """KV compaction: move the accepted nodes' K/V (src) into chain slots (dst).

    All sources are read before any destination is written, so overlapping moves (node j
    of the path usually moves down into the slot of an earlier, rejected node) are safe.
    """
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, *cache.shape[2:])
        flat[dst_slots] = flat[src_slots].clone()


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              batch: PagedBatch, scale: float) -> torch.Tensor:
    """q [T, NH, D] -> out [T, NH, D]; one request at a time (a reference, not a kernel)."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    qsl = batch.query_start_loc.tolist()
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = qsl[r], qsl[r + 1]
        q_len = end - start
        if q_len == 0:
            continue
        slots = slots_of(batch.block_table[r].long(), torch.arange(seq_len, device=q.device),
                         block_size)
        blocks, offsets = slots // block_size, slots % block_size         # views work too
        k, v = k_cache[blocks, offsets], v_cache[blocks, offsets]         # [L, KVH, D]
        window = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool, device=q.device))
        if bool(batch.is_tree[r]):
            window = bitmask_to_mask(batch.tree_mask[r, :q_len], q_len)
        visible = torch.cat([window.new_ones(q_len, seq_len - q_len), window], dim=1)
        group = q.shape[1] // kv_heads
        attn = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).float(),
            k.repeat_interleave(group, 1).transpose(0, 1).float(),
            v.repeat_interleave(group, 1).transpose(0, 1).float(),
            attn_mask=visible, scale=scale)
        out[start:end] = attn.transpose(0, 1).to(q.dtype)
    return out
