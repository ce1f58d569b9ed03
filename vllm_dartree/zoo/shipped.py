"""Drafters shipped inside the package (Domino checkpoint format, bf16).

    python -m vllm_dartree.zoo.shipped            # list them with their paths

`shipped_drafter(target)` is the folder of the drafter trained for a target, found by the
target folder's name (the name `zoo.smollm2` gives it) and checked against its config.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["SHIPPED", "shipped_dir", "shipped_drafter", "smollm2_pair", "main"]

# target folder name -> drafter folder under vllm_dartree/zoo/drafters/
SHIPPED = {"SmolLM2-135M-Instruct": "SmolLM2-135M-Instruct-DARTree"}


def shipped_dir(name: str) -> Path:
    return Path(__file__).parent / "drafters" / name


def shipped_drafter(target: str | Path) -> Path:
    """The shipped drafter for `target` (a model folder or its name); a clear error otherwise."""
    target = Path(target)
    if target.name not in SHIPPED:
        raise ValueError(f"no drafter is shipped for {target.name!r}; shipped for: "
                         f"{sorted(SHIPPED)} (pass a drafter folder instead)")
    folder = shipped_dir(SHIPPED[target.name])
    if not (folder / "model.safetensors").exists():
        raise FileNotFoundError(f"{folder}: the shipped drafter's weights are missing "
                                f"(a broken install or checkout)")
    config_file = target / "config.json"
    if config_file.exists():         # a model folder: the drafter must fit it
        from vllm_dartree.drafter import TargetInfo
        from vllm_dartree.drafter.checkpoint import check_drafter_folder
        tcfg = json.loads(config_file.read_text())
        check_drafter_folder(folder, TargetInfo(tcfg["hidden_size"], tcfg["vocab_size"],
                                                tcfg["num_hidden_layers"]))
    return folder


def smollm2_pair(target: str | None = None, drafter: str | None = None) -> tuple[str, str]:
    """What `--smollm2` means in every command: (target, drafter) = SmolLM2-135M-Instruct
    prepared from the package registry (cached) and its shipped drafter; either one given
    replaces its default."""
    if target is None:
        from vllm_dartree.zoo.smollm2 import prepare_smollm2
        target = str(prepare_smollm2())
    return target, drafter or str(shipped_drafter(target))


def main() -> None:
    for target, name in SHIPPED.items():
        folder = shipped_dir(name)
        size = sum(f.stat().st_size for f in folder.glob("*")) if folder.exists() else 0
        print(f"{target}: {folder} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
