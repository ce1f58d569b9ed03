"""Ancestor mask / bitmask construction from parent arrays, batched over requests.

Torch reference: `vllm_dartree.tree.structure.ancestor_mask` / `ancestor_bitmask`.
Grid: (R, cdiv(1 + N, BLOCK_ROWS)); each program walks BLOCK_ROWS columns of
`[root] + nodes` up to the root together, one parent hop per iteration (at most
max_depth + 1 iterations), and sets one mask column / one bit per hop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["tree_ancestor_mask", "tree_ancestor_bitmask"]


@triton.jit
def _tree_mask_kernel(
    parents_ptr, mask_ptr, bits_ptr,
    stride_pr, stride_mr, stride_mi, stride_br, stride_bi,
    N, NUM_STEPS,
    COLS_P2: tl.constexpr, WORDS_P2: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    WRITE_MASK: tl.constexpr, WRITE_BITS: tl.constexpr,
):
    req = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)   # columns 0..N
    row_ok = rows <= N
    cols = tl.arange(0, COLS_P2)
    words = tl.arange(0, WORDS_P2)
    acc_mask = tl.zeros([BLOCK_ROWS, COLS_P2], dtype=tl.int32)
    acc_bits = tl.zeros([BLOCK_ROWS, WORDS_P2], dtype=tl.int32)
    cur = tl.where(row_ok, rows, -1)
    # Phase 1: self, then one ancestor per step; the root's parent is -1 (lane done).
    for _ in range(NUM_STEPS):
        live = cur >= 0
        acc_mask = tl.where((cols[None, :] == cur[:, None]) & live[:, None], 1, acc_mask)
        bit = (tl.full([BLOCK_ROWS], 1, tl.int32) << (tl.maximum(cur, 0) % 32)).to(tl.int32)
        hit = (words[None, :] == (cur // 32)[:, None]) & live[:, None]
        acc_bits = acc_bits | tl.where(hit, bit[:, None], 0)
        # int32 whatever the parents' dtype: a loop-carried value must keep one type when
        # compiled (the interpreter does not check this; int64 parents failed on a GPU).
        par = tl.load(parents_ptr + req * stride_pr + (cur - 1), mask=live & (cur > 0),
                      other=-1).to(tl.int32)
        cur = tl.where(cur > 0, par + 1, -1)
    # Phase 2: write the rows.
    if WRITE_MASK:
        ptrs = mask_ptr + req * stride_mr + rows[:, None] * stride_mi + cols[None, :]
        tl.store(ptrs, acc_mask.to(tl.int8), mask=row_ok[:, None] & (cols[None, :] <= N))
    if WRITE_BITS:
        ptrs = bits_ptr + req * stride_br + rows[:, None] * stride_bi + words[None, :]
        num_words = N // 32 + 1
        tl.store(ptrs, acc_bits, mask=row_ok[:, None] & (words[None, :] < num_words))


def _launch(parents: torch.Tensor, max_depth: int | None, want_mask: bool, want_bits: bool):
    if parents.dim() != 2 or parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parents must be [R, N] int32/int64, got {tuple(parents.shape)} "
                         f"{parents.dtype}")
    parents = parents.contiguous()
    num_req, n = parents.shape
    cols, words = 1 + n, (1 + n + 31) // 32
    if cols > 4096:
        raise RuntimeError(f"tree of {n} nodes exceeds the kernel's 4095-node limit")
    mask = torch.zeros(num_req, cols, cols, dtype=torch.int8, device=parents.device) \
        if want_mask else parents.new_empty(1, 1, 1, dtype=torch.int8)
    bits = torch.zeros(num_req, cols, words, dtype=torch.int32, device=parents.device) \
        if want_bits else parents.new_empty(1, 1, 1, dtype=torch.int32)
    block_rows = min(32, triton.next_power_of_2(cols))
    steps = (n if max_depth is None else max_depth) + 1
    grid = (num_req, triton.cdiv(cols, block_rows))
    _tree_mask_kernel[grid](
        parents, mask, bits,
        parents.stride(0), mask.stride(0), mask.stride(1), bits.stride(0), bits.stride(1),
        n, steps,
        COLS_P2=triton.next_power_of_2(cols), WORDS_P2=triton.next_power_of_2(words),
        BLOCK_ROWS=block_rows, WRITE_MASK=want_mask, WRITE_BITS=want_bits,
    )
    return mask.view(torch.bool) if want_mask else None, bits if want_bits else None


def tree_ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """[R, N] parents (-1 = root) -> [R, 1 + N, 1 + N] bool ancestor-or-self mask."""
    return _launch(parents, max_depth, True, False)[0]


def tree_ancestor_bitmask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """[R, N] parents -> [R, 1 + N, ceil((1 + N) / 32)] int32, bit j % 32 of word j // 32."""
    return _launch(parents, max_depth, False, True)[1]
