"""The `custom_class` carrier vLLM instantiates in every worker: it loads the drafter.

vLLM builds `DARTreeProposer(vllm_config)` in the runner's `__init__` and calls
`load_model(target)` once the target is loaded (required on CPU). Drafting itself is done by
the dartree runner (`vllm_dartree.engine.runner`), which needs the target's hidden states
that vLLM's `propose(...)` call does not pass; `propose` therefore refuses to run.
"""

from __future__ import annotations

import importlib

import torch

from vllm_dartree.engine.drafters import CheckpointTreeDrafter, TreeDrafter
from vllm_dartree.engine.settings import EngineSettings

__all__ = ["DARTreeProposer", "target_weights"]


def target_weights(target: torch.nn.Module, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head [V, H] (vLLM pads the vocabulary rows)."""
    inner = getattr(target, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens"):
        embed = inner.embed_tokens.weight
    elif hasattr(target, "get_input_embeddings"):
        embed = target.get_input_embeddings().weight
    else:
        raise NotImplementedError(f"{type(target).__name__}: cannot find the input embedding "
                                  "that the drafter shares with the target")
    lm_head = getattr(target, "lm_head", None)
    head = embed if lm_head is None or not hasattr(lm_head, "weight") else lm_head.weight
    return embed[:vocab_size], head[:vocab_size]


class DARTreeProposer:
    def __init__(self, vllm_config):
        self.settings = EngineSettings.from_vllm_config(vllm_config)
        self.vllm_config = vllm_config
        self.tree_drafter: TreeDrafter | None = None

    def load_model(self, target: torch.nn.Module) -> None:
        text = self.vllm_config.model_config.hf_text_config
        settings = self.settings
        if settings.drafter_class is not None:
            module, _, name = settings.drafter_class.rpartition(".")
            factory = getattr(importlib.import_module(module), name)
            self.tree_drafter = factory(settings.config, settings.drafter, text.vocab_size)
            return
        from vllm_dartree.drafter import TargetInfo, load_drafter
        info = TargetInfo(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                          num_hidden_layers=text.num_hidden_layers)
        embed, head = target_weights(target, text.vocab_size)
        drafter = load_drafter(settings.drafter, info, embed, head,
                               dtype=self.vllm_config.model_config.dtype)
        self.tree_drafter = CheckpointTreeDrafter(
            settings.config, drafter,
            cuda_graphs=not self.vllm_config.model_config.enforce_eager,
            max_batch=self.vllm_config.scheduler_config.max_num_seqs)

    def propose(self, *args, **kwargs):
        raise RuntimeError("DARTreeProposer.propose was called: the dartree runner is not "
                           "installed (start vLLM with speculative_config={'method': 'dartree', "
                           "...}, which selects the dartree worker)")
