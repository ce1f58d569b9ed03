"""The dartree block of `VllmConfig.additional_config`: what crosses process boundaries.

`additional_config` is pickled into the engine core and every worker and hashed as JSON, so
the block holds plain values only; every process rebuilds the same `EngineSettings` from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_dartree.config import DARTreeConfig

__all__ = ["KEY", "EngineSettings"]

KEY = "dartree"


@dataclass(frozen=True)
class EngineSettings:
    config: DARTreeConfig
    drafter: str                    # drafter folder (or the oracle's file for drafter_class)
    drafter_class: str | None = None  # dotted path of a TreeDrafter factory (tests, research)

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.model_dump(), "drafter": self.drafter,
                "drafter_class": self.drafter_class}

    @classmethod
    def from_json(cls, block: dict[str, Any]) -> EngineSettings:
        return cls(DARTreeConfig(**block["config"]), block["drafter"], block.get("drafter_class"))

    @classmethod
    def from_vllm_config(cls, vllm_config) -> EngineSettings:
        extra = getattr(vllm_config, "additional_config", None) or {}
        if KEY not in extra:
            raise RuntimeError("the dartree worker was started without additional_config"
                               "['dartree']: pass speculative_config={'method': 'dartree', ...}")
        return cls.from_json(extra[KEY])
