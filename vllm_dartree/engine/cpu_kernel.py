"""The compiled CPU tree-attention kernel (`csrc/tree_attention_cpu.cpp`), built on first use.

torch's C++ extension loader compiles it once per machine and source (about a minute on two
cores; cached under `TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`). Without a
C++ compiler, or with `VLLM_DARTREE_CPU_KERNEL=0`, `load()` returns None and the CPU backend
keeps its torch (SDPA) path; the reason is logged once.

Vector flags are chosen from this CPU's flags and are part of the extension's name, so a
build cached for an AVX2 machine is never loaded on one without.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

__all__ = ["load", "enabled"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "tree_attention_cpu.cpp"
_UNSET = object()
_module = _UNSET


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _build_flags() -> tuple[str, list[str]]:
    flags = ["-O3", "-fopenmp"]   # ATen's parallel_for is OpenMP in its headers
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= _cpu_flags():
        return "avx2", flags + ["-mavx2", "-mfma"]
    return "generic", flags


def enabled() -> bool:
    return os.environ.get("VLLM_DARTREE_CPU_KERNEL", "1") != "0"


def load():
    """The compiled module (with `.tree_attention`), or None where it cannot be had."""
    global _module
    if _module is not _UNSET:
        return _module
    _module = None
    if not enabled():
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension
        isa, flags = _build_flags()
        _module = load_extension(name=f"dartree_tree_attention_cpu_{isa}",
                                 sources=[str(_SOURCE)], extra_cflags=flags,
                                 extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:   # no compiler, no headers: the SDPA path serves
        logger.warning("dartree: the compiled CPU tree attention is unavailable (%s: %s); "
                       "using the slower torch path", type(exc).__name__, exc)
    return _module
