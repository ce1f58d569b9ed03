"""The workers the plugin selects (`parallel_config.worker_cls`): they install the dartree
runner and, on CPU, the dartree attention backend, in the worker process itself (the class
name travels in the pickled config, so this works with the engine in its own process)."""

from __future__ import annotations

import logging
import os
import time

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_dartree.engine.gpu_attention import DARTreeGPUAttentionBackend
from vllm_dartree.engine.runner import DARTreeRunnerMixin, DARTreeWorkerMixin

__all__ = ["DARTreeCPUModelRunner", "DARTreeCPUWorker", "install_cpu_attention"]

logger = logging.getLogger("vllm.dartree")

CPU_BACKEND = "vllm_dartree.engine.cpu_attention.DARTreeCPUAttentionBackend"
# VLLM_DARTREE_CPU_ATTENTION: "sdpa" (default, the CPU backend) or "paged": the GPU
# backend's metadata builder and impl on CPU (kernel: the torch reference), to check the
# GPU path's engine code inside a real vLLM engine on a machine without a GPU.
CPU_BACKENDS = {"sdpa": CPU_BACKEND, "paged": "vllm_dartree.engine.worker.DARTreePagedCPUBackend"}


class DARTreeCPUModelRunner(DARTreeRunnerMixin, CPUModelRunner):
    pass


class DARTreePagedCPUBackend(CPUAttentionBackend):
    """The GPU backend's builder and impl in vLLM's CPU_ATTN slot (a CPUAttentionBackend
    subclass, so the CPU runner's checks hold); slow, for tests."""

    supported_kv_cache_dtypes = ["auto"]
    get_impl_cls = staticmethod(DARTreeGPUAttentionBackend.get_impl_cls)
    get_builder_cls = staticmethod(DARTreeGPUAttentionBackend.get_builder_cls)


def install_cpu_attention() -> None:
    """Put the dartree backend in vLLM's CPU_ATTN slot (the CPU platform uses no other)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    choice = os.environ.get("VLLM_DARTREE_CPU_ATTENTION", "sdpa")
    if choice not in CPU_BACKENDS:
        raise ValueError(f"VLLM_DARTREE_CPU_ATTENTION={choice!r}: use one of "
                         f"{sorted(CPU_BACKENDS)}")
    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKENDS[choice])
    _cached_get_attn_backend.cache_clear()


def build_tree_kernel() -> None:
    """Build (or load from torch's extension cache) the compiled CPU tree attention while the
    engine starts, not in the first step that verifies a tree: its first build on a machine
    takes about a minute on two cores (46 s on the EPYC of docs/engine.md's run AE), which
    the first request would otherwise wait out in the middle of its answer."""
    if os.environ.get("VLLM_DARTREE_CPU_ATTENTION", "sdpa") != "sdpa":
        return
    from vllm_dartree.engine import cpu_kernel
    if not cpu_kernel.enabled():
        return
    start = time.perf_counter()
    module = cpu_kernel.load()
    seconds = time.perf_counter() - start
    if module is not None and seconds > 5:
        logger.info("dartree: built the CPU tree-attention kernel (%s) in %.0f s; later "
                    "engines on this machine load it from torch's extension cache",
                    cpu_kernel.isa(), seconds)


class DARTreeCPUWorker(DARTreeWorkerMixin, CPUWorker):
    def init_device(self):
        install_cpu_attention()
        stock = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = DARTreeCPUModelRunner
        try:
            out = super().init_device()
        finally:
            cpu_worker.CPUModelRunner = stock
        build_tree_kernel()
        return out
