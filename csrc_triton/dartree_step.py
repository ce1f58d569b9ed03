"""One DARTree depth step fused: renormalise, add parent scores, global top-quota per request.

Torch reference: `vllm_dartree.tree.select.score_and_select_reference`.
Grid: (R,). Each program holds the [P, K] child tile of one request in registers:
phase 1 turns logits into log-probabilities (over the K candidates, or with the depth's
full-vocabulary normaliser), phase 2 adds the parent path scores, phase 3 pulls out the
best child `quota` times (argmax, then retire it), writing results best first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["score_and_select_triton", "fits"]

_MAX_TILE = 16384    # P_P2 * K_P2 held by one program
_MAX_QUOTA = 1024


@triton.jit
def _score_select_kernel(
    logits_ptr, parent_ptr, norm_ptr, out_score_ptr, out_pos_ptr, out_rank_ptr,
    stride_lr, stride_lp, stride_lk, stride_pr, stride_pp, stride_or,
    P, K, QUOTA,
    P_P2: tl.constexpr, K_P2: tl.constexpr, HAS_NORM: tl.constexpr,
):
    req = tl.program_id(0)
    p = tl.arange(0, P_P2)
    k = tl.arange(0, K_P2)
    ok = (p[:, None] < P) & (k[None, :] < K)
    x = tl.load(logits_ptr + req * stride_lr + p[:, None] * stride_lp + k[None, :] * stride_lk,
                mask=ok, other=float("-inf")).to(tl.float32)
    # Phase 1: log q of every child.
    if HAS_NORM:
        log_q = x - tl.load(norm_ptr + req).to(tl.float32)
    else:
        row_max = tl.max(x, axis=1)
        row_max = tl.where(p < P, row_max, 0.0)
        row_sum = tl.where(p < P, tl.sum(tl.exp(x - row_max[:, None]), axis=1), 1.0)
        lse = row_max + tl.log(row_sum)
        log_q = x - lse[:, None]
    # Phase 2: path scores.
    parent = tl.load(parent_ptr + req * stride_pr + p * stride_pp, mask=p < P,
                     other=float("-inf")).to(tl.float32)
    path = tl.where(ok, parent[:, None] + log_q, float("-inf"))
    # Phase 3: top-quota by repeated argmax. Live -inf children rank above retired slots
    # (key -FLT_MAX vs -inf), so every output is a distinct child.
    flat = tl.reshape(path, [P_P2 * K_P2])
    live = tl.reshape(ok, [P_P2 * K_P2])
    idx = tl.arange(0, P_P2 * K_P2)
    key = tl.where(live, tl.maximum(flat, -3.0e38), float("-inf"))
    for q in range(QUOTA):
        best = tl.argmax(key, axis=0)
        score = tl.sum(tl.where(idx == best, flat, 0.0), axis=0)
        tl.store(out_score_ptr + req * stride_or + q, score)
        tl.store(out_pos_ptr + req * stride_or + q, (best // K_P2).to(tl.int64))
        tl.store(out_rank_ptr + req * stride_or + q, (best % K_P2).to(tl.int64))
        key = tl.where(idx == best, float("-inf"), key)


def fits(logits: torch.Tensor, quota: int) -> bool:
    """Whether one program can hold this step (else the caller uses the torch reference)."""
    _, p, k = logits.shape
    return triton.next_power_of_2(p) * triton.next_power_of_2(k) <= _MAX_TILE \
        and quota <= _MAX_QUOTA


def score_and_select_triton(
    logits: torch.Tensor,
    parent_scores: torch.Tensor,
    log_norm: torch.Tensor | None,
    quota: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, P, K], parent_scores [R, P], log_norm [R] or None -> top-quota children.

    Returns scores [R, Q] float32, parent_pos [R, Q] int64, rank [R, Q] int64, best first.
    """
    if logits.dim() != 3 or parent_scores.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} must be [R, P, K] and parent_scores "
                         f"{tuple(parent_scores.shape)} must be [R, P]")
    num_req, p, k = logits.shape
    if not 1 <= quota <= p * k:
        raise ValueError(f"{quota = } must be in [1, P * K = {p * k}]")
    if not fits(logits, quota):
        raise RuntimeError(f"step of P = {p}, K = {k}, quota = {quota} exceeds one program "
                           f"(P_P2 * K_P2 <= {_MAX_TILE}, quota <= {_MAX_QUOTA})")
    if log_norm is not None and log_norm.shape != (num_req,):
        raise ValueError(f"log_norm {tuple(log_norm.shape)} must be [R] = [{num_req}]")
    scores = torch.empty(num_req, quota, dtype=torch.float32, device=logits.device)
    pos = torch.empty(num_req, quota, dtype=torch.int64, device=logits.device)
    rank = torch.empty_like(pos)
    norm = log_norm.contiguous() if log_norm is not None else scores
    _score_select_kernel[(num_req,)](
        logits, parent_scores, norm, scores, pos, rank,
        logits.stride(0), logits.stride(1), logits.stride(2),
        parent_scores.stride(0), parent_scores.stride(1), scores.stride(0),
        p, k, quota,
        P_P2=triton.next_power_of_2(p), K_P2=triton.next_power_of_2(k),
        HAS_NORM=log_norm is not None,
    )
    return scores, pos, rank
