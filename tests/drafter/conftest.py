"""A tiny random Qwen3 target (real BPE tokenizer) shared by the drafter tests."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vllm_dartree.drafter import TargetInfo, load_drafter
from vllm_dartree.testing import write_tiny_drafter, write_tiny_target


@dataclass
class TinyTarget:
    folder: Path
    model: torch.nn.Module
    info: TargetInfo

    def load(self, folder):
        return load_drafter(folder, self.info, self.model.model.embed_tokens.weight,
                            self.model.lm_head.weight, dtype=torch.float32)

    def features(self, ids: torch.Tensor, layer_ids) -> torch.Tensor:
        """[T] token ids -> the target's context features [T, n*H] (hidden_states[l + 1])."""
        with torch.no_grad():
            out = self.model(ids[None], output_hidden_states=True)
        return torch.cat([out.hidden_states[l + 1][0] for l in layer_ids], dim=-1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> TinyTarget:
    from transformers import AutoModelForCausalLM

    folder = write_tiny_target(tmp_path_factory.mktemp("target"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = model.config
    return TinyTarget(folder, model, TargetInfo(cfg.hidden_size, cfg.vocab_size,
                                                cfg.num_hidden_layers))


@pytest.fixture(scope="session")
def drafter_folders(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("drafters")
    return {fmt: write_tiny_drafter(root / fmt, fmt, tiny_target.folder)
            for fmt in ("dflash", "domino", "domino-legacy", "dspark")}
