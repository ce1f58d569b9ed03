"""Engine tests: tiny models written once per session, and vLLM engines run as subprocesses
(one engine per process, its outputs as JSON; see llm_job.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_dartree.testing import write_tiny_drafter, write_tiny_target

JOB = Path(__file__).with_name("llm_job.py")
# A small tree so that the tiny engines stay fast; the same for every builder.
TREE = {"budget": 16, "width": 4, "topk": 8}


@pytest.fixture(scope="session", autouse=True)
def cpu_kernel_built():
    """Build the compiled CPU attention once, before any engine starts (on a fresh machine
    the first engine would otherwise spend its start-up compiling it)."""
    from vllm_dartree.engine import cpu_kernel
    return cpu_kernel.load()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny Qwen3 target (head_dim 32: the stock CPU attention needs >= 32) and a tiny
    Domino-format drafter for it."""
    root = tmp_path_factory.mktemp("engine-models")
    target = write_tiny_target(root / "target", head_dim=32, seed=1)
    drafter = write_tiny_drafter(root / "domino", "domino", target)
    return {"root": root, "target": target, "drafter": drafter}


def engine_kwargs(target, **overrides):
    """LLM(...) arguments of the engine tests. The worker runs inside the engine process
    (`uni`) and, with VLLM_ENABLE_V1_MULTIPROCESSING=0 (run_job), the engine inside the
    job's process: an engine then starts in about 6 s instead of 40 (each process imports
    vLLM again). vLLM's multiprocess executor and engine process, what `LLM(...)` and
    `vllm serve` use by default, are run by the tensor-parallel, server and load tests."""
    kw = dict(model=str(target), dtype="float32", enforce_eager=True, max_model_len=512,
              gpu_memory_utilization=0.2, seed=0, disable_log_stats=False,
              distributed_executor_backend="uni")
    kw.update(overrides)
    return kw


def dartree_spec(drafter, **overrides):
    return {"method": "dartree", "model": str(drafter), **TREE, **overrides}


def run_job(tmp_path, engine: dict, batches: list[dict], timeout: int = 900,
            env: dict | None = None, **options) -> dict:
    """Run one engine over `batches` in a fresh process (extra environment `env`, extra
    llm_job.py `options`); returns llm_job.py's JSON."""
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    for i in range(1000):
        job, out = tmp_path / f"job{i}.json", tmp_path / f"out{i}.json"
        if not job.exists():
            break
    job.write_text(json.dumps({"engine": engine, "batches": batches, **options}))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               **(env or {}))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(JOB), str(job), str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"engine job failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def mixed_prompts(n=34, seed=3):
    """n prompts of 1..120 tokens, plus one of 300 tokens (chunked at 160 tokens/step)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 120, (n - 1,), generator=gen).tolist() + [300]
    return [torch.randint(5, 1000, (length,), generator=gen).tolist() for length in lengths]
