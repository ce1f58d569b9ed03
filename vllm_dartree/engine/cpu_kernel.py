"""The compiled CPU tree-attention kernel (`csrc/tree_attention_cpu.cpp`), built when a CPU
worker starts (`engine.worker.build_tree_kernel`; the first caller otherwise).

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

__all__ = ["load", "enabled", "isa", "cpu_flags"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "tree_attention_cpu.cpp"
_UNSET = object()
_module = _UNSET
_isa: str | None = None


def cpu_flags() -> set[str]:
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
    cpu = cpu_flags() if platform.machine() in ("x86_64", "AMD64") else set()
    if {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx2", "fma"} <= cpu:
        # 16-lane FMAs: twice the AVX2 build's speed on a Xeon here (one tree of 13 rows
        # over 500 positions, 30 layers: 5.0 against 10.6 ms)
        return "avx512", flags + ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw",
                                  "-mavx512dq"]
    if {"avx2", "fma"} <= cpu:
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
        global _isa
        isa, flags = _build_flags()
        _module = load_extension(name=f"dartree_tree_attention_cpu_{isa}",
                                 sources=[str(_SOURCE)], extra_cflags=flags,
                                 extra_ldflags=["-fopenmp"], verbose=False)
        _isa = isa
    except Exception as exc:   # no compiler, no headers: the SDPA path serves
        logger.warning("dartree: the compiled CPU tree attention is unavailable (%s: %s); "
                       "using the slower torch path", type(exc).__name__, exc)
    return _module


def isa() -> str | None:
    """The vector ISA the loaded kernel was built for ("avx512", "avx2", "generic"); None
    while it is not loaded."""
    return _isa if load() is not None else None
