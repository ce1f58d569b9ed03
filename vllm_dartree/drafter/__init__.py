"""Drafter models and their correction heads (pure torch; no vllm import).

- `spec`: the checkpoint's config.json as a validated DrafterSpec (DFlash, Domino, DSpark).
- `backbone`: the block-diffusion backbone and its per-request context K/V cache.
- `gru_head`, `markov_head`: Domino's GRU and DSpark's Markov correction heads, both
  implementing the contract of `vllm_dartree.tree.heads` (init / prepare / score / advance).
- `checkpoint`: loading and validating released checkpoint folders.
"""

from vllm_dartree.drafter.backbone import ContextCache, DFlashBackbone, DraftOutput
from vllm_dartree.drafter.checkpoint import CheckpointError, Drafter, load_drafter
from vllm_dartree.drafter.gru_head import DominoGRUHead, GRUPrepared
from vllm_dartree.drafter.markov_head import MarkovHead
from vllm_dartree.drafter.spec import (
    DrafterSpec,
    TargetInfo,
    build_target_layer_ids,
    parse_drafter_config,
)

__all__ = [
    "CheckpointError", "ContextCache", "DFlashBackbone", "DominoGRUHead", "DraftOutput",
    "Drafter", "DrafterSpec", "GRUPrepared", "MarkovHead", "TargetInfo",
    "build_target_layer_ids", "load_drafter", "parse_drafter_config",
]
