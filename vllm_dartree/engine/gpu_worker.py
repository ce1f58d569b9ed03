"""The dartree worker on CUDA (`parallel_config.worker_cls`, set by the plugin): vLLM's GPU
worker with the dartree V1 runner, and dartree's Triton tree attention installed as vLLM's
CUSTOM attention backend in the worker process itself (before any model is built)."""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_dartree.engine.plugin import GPU_BACKEND
from vllm_dartree.engine.runner import DARTreeRunnerMixin, DARTreeWorkerMixin

__all__ = ["DARTreeGPUModelRunner", "DARTreeGPUWorker", "install_gpu_attention"]


class DARTreeGPUModelRunner(DARTreeRunnerMixin, GPUModelRunner):
    pass


def install_gpu_attention() -> None:
    """Point vLLM's CUSTOM attention backend at dartree's (idempotent, per process)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    register_backend(AttentionBackendEnum.CUSTOM, GPU_BACKEND)
    _cached_get_attn_backend.cache_clear()


class DARTreeGPUWorker(DARTreeWorkerMixin, Worker):
    def init_device(self):
        install_gpu_attention()
        return super().init_device()

    def _make_model_runner(self):
        if self.use_v2_model_runner:
            raise RuntimeError("dartree runs on vLLM's V1 model runner: unset "
                               "VLLM_USE_V2_MODEL_RUNNER")
        return DARTreeGPUModelRunner(self.vllm_config, self.device)
