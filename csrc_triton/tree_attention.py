"""Paged attention for mixed batches with per-request tree masks (prefill chunks, decode rows,
tree-verify rows in one launch), GQA, vLLM's block-table layout.

Torch reference: `vllm_dartree.attention.paged.paged_attention_reference` (same semantics:
request r's rows are the last q_len positions of its sequence; a row sees the committed
context and, inside its window, the causal triangle or its tree-mask bits).
Grid: (R, cdiv(max q_len, BLOCK_M), num_heads). Each program: one request, BLOCK_M query
rows, one query head; it streams the request's KV in BLOCK_N tiles through the block table
with an online softmax (flash-attention style).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["tree_attention"]


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, seq_lens_ptr, table_ptr, is_tree_ptr, tmask_ptr,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tr, stride_mr, stride_mi,
    scale,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)        # row within the request
    if tl.program_id(1) * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len
    is_tree = tl.load(is_tree_ptr + req) != 0
    d = tl.arange(0, HEAD_DIM)
    row_ok = rows < q_len
    tree_rows = row_ok & (tl.zeros([BLOCK_M], tl.int32) + is_tree.to(tl.int32) != 0)
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    # Phase 1: online softmax over the request's keys, BLOCK_N positions at a time.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        pos_ok = pos < seq_len
        block = tl.load(table_ptr + req * stride_tr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        base = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=pos_ok[:, None], other=0.0)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=pos_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        # Phase 2: visibility = context, or inside the window: causal / tree bit.
        col_w = pos - ctx_len                                          # window column
        in_win = col_w >= 0
        bits = tl.load(tmask_ptr + req * stride_mr + rows[:, None] * stride_mi
                       + tl.maximum(col_w, 0)[None, :] // 32,
                       mask=tree_rows[:, None] & in_win[None, :] & pos_ok[None, :], other=0)
        tree_ok = ((bits >> (tl.maximum(col_w, 0)[None, :] % 32)) & 1) != 0
        causal_ok = col_w[None, :] <= rows[:, None]
        win_ok = tl.where(is_tree, tree_ok, causal_ok)
        visible = pos_ok[None, :] & ((~in_win)[None, :] | win_ok) & row_ok[:, None]
        s = tl.where(visible, s * scale, float("-inf"))
        # Phase 3: rescale the running sums.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   block_table: torch.Tensor, is_tree: torch.Tensor, tree_mask: torch.Tensor,
                   scale: float, max_query_len: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, NH, D]; k/v_cache [num_blocks, block_size, KVH, D] (views with equal strides,
    e.g. K and V halves of vLLM's cache; last dimension dense); query_start_loc [R + 1];
    seq_lens [R]; block_table [R, max_blocks]; is_tree [R] bool or int8; tree_mask
    [R, Qmax, words] int32 (read only on tree requests). Returns out [T, NH, D] in q's
    dtype (written into `out` when given)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} must be [T, NH, D] and k/v caches "
                         f"{tuple(k_cache.shape)} [num_blocks, block_size, KVH, D]")
    _, num_heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % kv_heads:
        raise ValueError(f"{head_dim = } must equal the cache's {cache_dim} and "
                         f"{num_heads = } must be a multiple of {kv_heads = }")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise NotImplementedError(f"{head_dim = } must be a power of two >= 16")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("k/v caches must have equal strides and, like q, a dense last "
                         "dimension")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1 or out.stride()[:2] != q.stride()[:2]:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape and strides")
    block_m = 16
    grid = (seq_lens.shape[0], triton.cdiv(max(max_query_len, 1), block_m), num_heads)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
        is_tree if is_tree.dtype == torch.int8 else is_tree.to(torch.int8), tree_mask,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), tree_mask.stride(0), tree_mask.stride(1),
        scale,
        GROUP=num_heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=32, IEEE=q.dtype == torch.float32,
    )
    return out
