"""Triton kernels of vllm-dartree (installed as `vllm_dartree.csrc_triton`).

Each kernel names its torch reference in `vllm_dartree`; callers go through the dispatch
module `vllm_dartree.ops`, which only imports these modules for CUDA tensors. Tests run
them on CPU tensors under `TRITON_INTERPRET=1`.

- `tree_mask`: ancestor masks and bitmasks of `[root] + nodes` from parent arrays.
- `dartree_step`: one DARTree depth: renormalise, add parent scores, global top-quota.
- `tree_attention`: paged attention for mixed batches with per-request tree masks.
"""

__all__ = ["tree_mask", "dartree_step", "tree_attention"]
