"""Paged attention for mixed batches with per-request tree masks (prefill chunks, decode rows,
tree-verify rows in one launch), GQA, vLLM's block-table layout.

Torch reference: `vllm_dartree.attention.paged.paged_attention_reference` (same semantics:
request r's rows are the last q_len positions of its sequence; a row sees the committed
context and, inside its window, the causal triangle or its tree-mask bits).
Grid: (R, cdiv(max q_len, BLOCK_M), KVH * NUM_SPLITS). Each program: one request, BLOCK_M
query rows times the GROUP query heads that share one KV head (stacked as the rows of one
tile, so each K/V tile is read once per group, not once per head), and one of NUM_SPLITS
slices of the request's keys, streamed in BLOCK_N tiles through the block table with an
online softmax (flash-attention style). Causal requests stop at the last key their rows can
see. With one split the program writes the output; with several (few programs for the
machine: small batches, long contexts) each writes its running max, sum and unnormalised
output, and `_combine_kernel` merges the slices (flash-decoding style).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

__all__ = ["tree_attention"]

MAX_SPLITS = 16


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    qsl_ptr, seq_lens_ptr, table_ptr, is_tree_ptr, tmask_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_tr,
    stride_mr, stride_mi, scale, num_heads,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if tl.program_id(1) * BLOCK_M >= q_len:
        return
    # Tile row i = query row i // GROUP_P2 of this block, query head kv_head * GROUP + i % GROUP_P2.
    i = tl.arange(0, BLOCK_M * GROUP_P2)
    rows = tl.program_id(1) * BLOCK_M + i // GROUP_P2                  # row within the request
    g = i % GROUP_P2
    head = kv_head * GROUP + g
    row_ok = (rows < q_len) & (g < GROUP)
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len
    is_tree = tl.load(is_tree_ptr + req) != 0
    d = tl.arange(0, HEAD_DIM)
    tree_rows = row_ok & (tl.zeros([BLOCK_M * GROUP_P2], tl.int32) + is_tree.to(tl.int32) != 0)
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :], mask=row_ok[:, None], other=0.0)
    # This program's keys: causal rows see nothing past their block's last row.
    last_row = tl.minimum(q_len, (tl.program_id(1) + 1) * BLOCK_M)
    kv_end = tl.where(is_tree, seq_len, tl.minimum(seq_len, ctx_len + last_row))
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    # Phase 1: online softmax over the slice's keys, BLOCK_N positions at a time.
    m_i = tl.full([BLOCK_M * GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P2], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P2, HEAD_DIM], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
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
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head[:, None] * stride_oh
                 + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = ((q_start + rows) * num_heads + head) * NUM_SPLITS + split
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, qsl_ptr, stride_ot, stride_oh, num_heads, num_req,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """One (token, head): merge the slices' softmax states. Padding tokens past the last
    request (CUDA-graph batches) are left alone, as with one slice."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(qsl_ptr + num_req):
        return
    s = tl.arange(0, SPLITS_P2)
    ok = s < NUM_SPLITS
    part = (token * num_heads + head) * NUM_SPLITS + s
    m = tl.load(m_ptr + part, mask=ok, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))       # 0 where m = -inf
    live = weight > 0
    l_s = tl.load(l_ptr + part, mask=ok & live, other=0.0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=(ok & live)[:, None],
                  other=0.0)
    num = tl.sum(acc * weight[:, None], axis=0)
    den = tl.sum(l_s * weight, axis=0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d,
             (num / tl.where(den == 0, 1.0, den)).to(out_ptr.dtype.element_ty))


@lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(device: torch.device, programs: int, block_n: int, max_seq_len: int | None) -> int:
    """Slices per program so that small batches still fill the machine (about two programs
    per SM), none shorter than 4 key tiles when the longest sequence is known; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    want = -(-2 * _num_sms(device) // programs)
    if max_seq_len is not None:
        want = min(want, -(-max_seq_len // (4 * block_n)))
    return max(1, min(MAX_SPLITS, want))


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   block_table: torch.Tensor, is_tree: torch.Tensor, tree_mask: torch.Tensor,
                   scale: float, max_query_len: int,
                   out: torch.Tensor | None = None, *, max_seq_len: int | None = None,
                   num_splits: int | None = None, block_n: int = 64,
                   num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """q [T, NH, D]; k/v_cache [num_blocks, block_size, KVH, D] (views with equal strides,
    e.g. K and V halves of vLLM's cache; last dimension dense); query_start_loc [R + 1];
    seq_lens [R]; block_table [R, max_blocks]; is_tree [R] bool or int8; tree_mask
    [R, Qmax, words] int32 (read only on tree requests). Returns out [T, NH, D] in q's
    dtype (written into `out` when given). `max_seq_len` (the longest sequence, if the
    caller knows it) bounds the key slices; `num_splits` forces their number (tests);
    `num_warps` / `num_stages` override Triton's launch defaults (tuning)."""
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
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape and a dense last "
                         "dimension")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{block_n = } must be a power of two >= 16")
    group = num_heads // kv_heads
    group_p2 = triton.next_power_of_2(group)
    # query rows per program: the tile (rows x group) has 16-64 rows (tl.dot needs >= 16)
    block_m = max(1, min(triton.next_power_of_2(max(max_query_len, 1)), 64 // group_p2))
    block_m = max(block_m, 16 // group_p2)
    num_req = seq_lens.shape[0]
    row_blocks = triton.cdiv(max(max_query_len, 1), block_m)
    splits = num_splits if num_splits is not None else _splits(
        q.device, num_req * row_blocks * kv_heads, block_n, max_seq_len)
    if not 1 <= splits <= 64:
        raise ValueError(f"num_splits = {splits} must be in 1..64")
    if splits > 1:
        tokens = q.shape[0]
        m_part = torch.empty(tokens, num_heads, splits, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(tokens, num_heads, splits, head_dim, dtype=torch.float32,
                               device=q.device)
    else:
        m_part = l_part = acc_part = out     # unused
    _tree_attention_kernel[(num_req, row_blocks, kv_heads * splits)](
        q, k_cache, v_cache, out, m_part, l_part, acc_part, query_start_loc, seq_lens,
        block_table, is_tree if is_tree.dtype == torch.int8 else is_tree.to(torch.int8),
        tree_mask,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_table.stride(0), tree_mask.stride(0),
        tree_mask.stride(1), scale, num_heads,
        GROUP=group, GROUP_P2=group_p2, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=splits, IEEE=q.dtype == torch.float32,
        **{k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v},
    )
    if splits > 1:
        _combine_kernel[(q.shape[0], num_heads)](
            m_part, l_part, acc_part, out, query_start_loc, out.stride(0), out.stride(1),
            num_heads, num_req, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
        )
    return out
