"""Drafter models and their correction heads (pure torch; no vllm import).

For now: the Domino GRU correction head. The block-diffusion backbone, the DSpark Markov
head and checkpoint loading arrive with the drafter issue.
"""

from vllm_dartree.drafter.gru_head import DominoGRUHead, GRUPrepared

__all__ = ["DominoGRUHead", "GRUPrepared"]
