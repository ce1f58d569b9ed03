"""The one dispatch point for kernels: Triton (csrc_triton) on CUDA tensors, torch elsewhere.

Each op names its torch reference; the Triton modules are imported lazily, only when a CUDA
tensor arrives, so CPU-only installs never import Triton here.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from vllm_dartree.tree.select import score_and_select_reference
from vllm_dartree.tree.structure import ancestor_bitmask as ancestor_bitmask_reference
from vllm_dartree.tree.structure import ancestor_mask as ancestor_mask_reference

if TYPE_CHECKING:
    from vllm_dartree.attention.paged import PagedBatch

__all__ = ["use_triton", "ancestor_mask", "ancestor_bitmask", "score_and_select",
           "paged_attention", "argmax"]

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("Triton is not importable: using the torch references on CUDA too.")
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel serves this tensor (CUDA device and Triton present)."""
    return tensor.is_cuda and _triton_available()


@lru_cache(maxsize=1)
def _cpu_greedy_argmax():
    """vLLM's CPU kernel `_C.greedy_argmax` (what its sampler's greedy path calls on the
    CPU), or None without vLLM's CPU ops."""
    try:
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C
        return torch.ops._C.greedy_argmax
    except Exception:   # noqa: BLE001 - no vLLM, or no CPU build of its ops
        return None


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`: the index of the first maximum of every row (NaN counts as
    the maximum). On the CPU, 2-D fp32 logits go through vLLM's `greedy_argmax` kernel
    (the one its sampler uses for greedy rows), the rest through `max(dim=-1).indices`,
    which torch documents to return the same first index. A tree step's walk reads every
    row's: 9 / 16 / 40 rows of 49,152 logits on one core of an AMD EPYC took 0.13 / 0.29 /
    0.55 ms in vLLM's kernel, 0.40 / 0.75 / 2.07 ms in torch's `max` (`argmax` no faster)."""
    if logits.is_cuda:
        return logits.argmax(dim=-1)
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[0]:
        kernel = _cpu_greedy_argmax()
        if kernel is not None:
            return kernel(logits)
    return logits.max(dim=-1).indices


def ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """[R, N] parents -> [R, 1 + N, 1 + N] bool ancestor-or-self mask of [root] + nodes."""
    if use_triton(parents):
        from vllm_dartree.csrc_triton.tree_mask import tree_ancestor_mask
        return tree_ancestor_mask(parents, max_depth)
    return ancestor_mask_reference(parents, max_depth)


def ancestor_bitmask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """[R, N] parents -> [R, 1 + N, ceil((1 + N) / 32)] int32 packed ancestor mask."""
    if use_triton(parents):
        from vllm_dartree.csrc_triton.tree_mask import tree_ancestor_bitmask
        return tree_ancestor_bitmask(parents, max_depth)
    return ancestor_bitmask_reference(parents, max_depth)


def score_and_select(
    logits: torch.Tensor,
    parent_scores: torch.Tensor,
    log_norm: torch.Tensor | None,
    quota: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One DARTree depth step; see `tree.select.score_and_select_reference`."""
    if use_triton(logits):
        from vllm_dartree.csrc_triton.dartree_step import fits, score_and_select_triton
        if fits(logits, quota):
            return score_and_select_triton(logits, parent_scores, log_norm, quota)
    return score_and_select_reference(logits, parent_scores, log_norm, quota)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: PagedBatch, scale: float, max_query_len: int,
                    out: torch.Tensor | None = None,
                    max_seq_len: int | None = None) -> torch.Tensor:
    """Mixed-batch paged attention with tree masks; see `attention.paged`. Writes into
    `out` ([T, NH, D], q's layout) when given; `max_seq_len`, when known, lets the Triton
    kernel size its key slices."""
    if use_triton(q):
        from vllm_dartree.csrc_triton.tree_attention import tree_attention
        return tree_attention(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                              batch.block_table, batch.is_tree, batch.tree_mask, scale,
                              max_query_len, out=out, max_seq_len=max_seq_len)
    from vllm_dartree.attention.paged import paged_attention_reference
    result = paged_attention_reference(q, k_cache, v_cache, batch, scale)
    if out is None:
        return result
    out.copy_(result)
    return out
