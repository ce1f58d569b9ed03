"""Run one vLLM engine in its own process and write what it produced as JSON.

    python llm_job.py job.json out.json

job.json: {"engine": {LLM kwargs}, "batches": [{"prompts": [[ids...], ...],
"params": [{SamplingParams kwargs}, ...]}, ...]}. The output lists, per batch and request,
the token ids, the finish reason and vLLM's per-request spec-decode metrics, plus the
engine's spec-decode counters (and, with dartree, the adaptive budget's). One engine per process keeps tests independent of vLLM's
teardown.
"""

import json
import sys


def _drafter_tables(worker):
    """Row-weighted sums of the drafter's embedding and lm-head tables on this worker (None
    where no checkpoint drafter is loaded, e.g. tensor-parallel ranks other than 0)."""
    import torch
    backbone = getattr(getattr(worker.model_runner.drafter.tree_drafter, "drafter", None),
                       "backbone", None)
    if backbone is None:
        return None
    out = []
    for w in (backbone.embed_weight, backbone.lm_head_weight):
        rows = torch.arange(1, w.shape[0] + 1, dtype=torch.float64)[:, None]
        out.append([int(w.shape[0]), float((w.double() * rows).sum())])
    return out


def _kernel_resolved(worker):
    """Whether this worker's process has already resolved the compiled CPU tree attention
    (built, loaded, or found unavailable)."""
    from vllm_dartree.engine import cpu_kernel
    return cpu_kernel._module is not cpu_kernel._UNSET


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams

    llm = LLM(**job["engine"])
    result = {"batches": []}
    if job.get("kernel_state"):   # before any request (needs VLLM_ALLOW_INSECURE_SERIALIZATION)
        result["kernel_resolved"] = llm.collective_rpc(_kernel_resolved)
    for batch in job["batches"]:
        prompts = [{"prompt_token_ids": p} for p in batch["prompts"]]
        params = [SamplingParams(**p) for p in batch["params"]]
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["batches"].append([{
            "tokens": list(o.outputs[0].token_ids),
            "finish_reason": o.outputs[0].finish_reason,
            "logprobs": len(o.outputs[0].logprobs) if o.outputs[0].logprobs else None,
            # the sampled token's logprob at every position (None without logprobs)
            "logprob_values": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                              o.outputs[0].token_ids)]
            if o.outputs[0].logprobs else None,
            "spec": (o.outputs[0].spec_decode_metrics.to_dict()
                     if o.outputs[0].spec_decode_metrics is not None else None),
        } for o in outs])
    counters = {}
    for metric in llm.get_metrics():
        wanted = metric.name.startswith(("vllm:spec_decode", "vllm:num_preemptions"))
        if wanted and hasattr(metric, "value"):
            counters[metric.name] = metric.value
        elif wanted and hasattr(metric, "values"):
            counters[metric.name] = list(metric.values)
    result["counters"] = counters
    # An in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) steps only while requests are
    # unfinished, so the worker hears of the last finished ones at the next step: run it
    # (the engine process of the default mode does so by itself), then read the state.
    llm.llm_engine.step()
    spec = job["engine"].get("speculative_config") or {}
    if spec.get("method") == "dartree":   # the adaptive budget's counters ({} when off)
        result["budget"] = llm.collective_rpc("dartree_budget")[0]
    if job.get("drafter_tables"):   # needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
        result["drafter_tables"] = llm.collective_rpc(_drafter_tables)
    open(sys.argv[2], "w").write(json.dumps(result))


if __name__ == "__main__":
    main()
