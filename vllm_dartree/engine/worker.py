"""The workers the plugin selects (`parallel_config.worker_cls`): they install the dartree
runner and, on CPU, the dartree attention backend, in the worker process itself (the class
name travels in the pickled config, so this works with the engine in its own process)."""

from __future__ import annotations

import os

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_dartree.engine.gpu_attention import DARTreeGPUAttentionBackend
from vllm_dartree.engine.runner import DARTreeRunnerMixin, DARTreeWorkerMixin

__all__ = ["DARTreeCPUModelRunner", "DARTreeCPUWorker", "install_cpu_attention"]

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


class DARTreeCPUWorker(DARTreeWorkerMixin, CPUWorker):
    def init_device(self):
        install_cpu_attention()
        stock = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = DARTreeCPUModelRunner
        try:
            return super().init_device()
        finally:
            cpu_worker.CPUModelRunner = stock
