"""One DARTree depth step: score the children of every kept prefix and keep the best.

Torch reference of the fused Triton kernel `csrc_triton.dartree_step` (reached through
`vllm_dartree.ops.score_and_select`). Paper, Algorithm 1, lines 5-9.
"""

from __future__ import annotations

import torch

__all__ = ["score_and_select_reference"]


def score_and_select_reference(
    logits: torch.Tensor,
    parent_scores: torch.Tensor,
    log_norm: torch.Tensor | None,
    quota: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global top-`quota` children per request, best first.

    logits:        [R, P, K] candidate logits of each prefix's K children
    parent_scores: [R, P]    path log-probabilities of the prefixes (-inf = no prefix)
    log_norm:      [R] full-vocabulary normaliser of an uncorrected depth, or None to
                   renormalise each prefix's logits over its K candidates
    Returns scores [R, Q] (float32, or float64 for float64 inputs), parent_pos [R, Q] and
    rank [R, Q] int64 (the child is candidate `rank` of prefix `parent_pos`), with
    Q = quota <= P * K.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)      # fp32, or fp64 in tests
    logits = logits.to(dtype)
    if log_norm is None:
        log_q = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    else:
        log_q = logits - log_norm.to(dtype)[:, None, None]
    path = parent_scores.to(dtype)[:, :, None] + log_q                # [R, P, K]
    k = logits.shape[-1]
    scores, flat = torch.topk(path.flatten(1), quota, dim=1)
    return scores, flat // k, flat % k
