"""Output tokens per second in vLLM: plain decoding vs DARTree vs the DDTree and chain
builders (same drafter), at several concurrencies, measured in one run.

    python examples/engine_bench.py                      # tiny random models, written here
    python examples/engine_bench.py --target DIR --drafter DIR [--prompts FILE.jsonl]

Each method runs in its own engine process (one vLLM engine per process); inside it, every
concurrency level c sends the same requests c at a time and times them after a warm-up.
Printed per method and level: output tokens/s, the ratio to plain decoding at that level,
tau (vLLM's mean acceptance length), and the share of the wall time the dartree worker
spent in the target's forward (`execute_model`), drafting, the tree walk and KV compaction.
`oracle` is a drafter that knows the target's greedy continuation (tau = depth + 1): the
ceiling that tree verification reaches in this engine when the drafter is right.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("plain", "dartree", "ddtree", "chain", "oracle")


def _engine_kwargs(args, method: str, oracle_file: str | None) -> dict:
    kw = dict(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.2, max_num_seqs=max(args.concurrency), seed=0,
              disable_log_stats=False,
              max_num_batched_tokens=max(2048, max(args.concurrency) * (args.budget + 1)))
    tree = {"method": "dartree", "model": args.drafter, "budget": args.budget,
            "width": args.width, "topk": args.topk}
    if method in ("dartree", "ddtree", "chain"):
        kw["speculative_config"] = {**tree, "builder": method}
    elif method == "oracle":
        kw["speculative_config"] = {**tree, "model": oracle_file, "budget": 2 * args.depth,
                                    "drafter_class":
                                        "vllm_dartree.engine.drafters.OracleTreeDrafter"}
    return kw


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            out[m.name] = m.value
    return out


def worker(job_path: str) -> None:
    """One engine: every concurrency level, timed; writes JSON next to the job."""
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(**job["engine"])
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0,
                            ignore_eos=job.get("ignore_eos", True))
    llm.generate(prompts[:2], params, use_tqdm=False)     # warm-up
    spec = "speculative_config" in job["engine"]
    results = {"levels": {}, "outputs": None}
    for c in job["concurrency"]:
        before = _counters(llm)
        if spec:
            llm.collective_rpc("dartree_seconds", kwargs={"reset": True})
        start, outputs = time.perf_counter(), []
        for i in range(0, len(prompts), c):
            outputs += llm.generate(prompts[i:i + c], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = _counters(llm)
        drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
            "vllm:spec_decode_num_drafts", 0)
        accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
            "vllm:spec_decode_num_accepted_tokens", 0)
        stages = llm.collective_rpc("dartree_seconds")[0] if spec else {}
        results["levels"][str(c)] = {
            "seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "tau": 1 + accepted / drafts if drafts else None, "stages": stages}
        results["outputs"] = [list(o.outputs[0].token_ids) for o in outputs]
    Path(job_path).with_suffix(".out.json").write_text(json.dumps(results))


def run_engine(job: dict, workdir: Path, name: str) -> dict:
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(job))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get(
        "VLLM_CPU_OMP_THREADS_BIND", "nobind"), TOKENIZERS_PARALLELISM="false")
    print(f"[{name}] engine running ...", flush=True)
    proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"[{name}] failed:\n{proc.stderr[-4000:]}")
    return json.loads(path.with_suffix(".out.json").read_text())


def _prompts(args) -> list[list[int]]:
    if args.prompts:
        from transformers import AutoTokenizer

        from vllm_dartree.bench.datasets import read_prompt_ids
        tok = AutoTokenizer.from_pretrained(args.target)
        return read_prompt_ids(args.prompts, tok, limit=args.requests)[1]
    import torch
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(5, 1000, (int(n),), generator=gen).tolist()
            for n in torch.randint(16, 64, (args.requests,), generator=gen)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--target", help="target model folder (default: tiny random Qwen3)")
    parser.add_argument("--drafter", help="drafter folder (default: tiny random Domino)")
    parser.add_argument("--prompts", help="JSONL file with {'prompt': text} lines")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--depth", type=int, default=8, help="oracle tree depth")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="dartree-bench-"))
    if not args.target:
        from vllm_dartree.testing import write_tiny_drafter, write_tiny_target
        args.target = str(write_tiny_target(workdir / "target", head_dim=32, seed=1))
        args.drafter = str(write_tiny_drafter(workdir / "domino", "domino", args.target))
    elif not args.drafter and set(methods) - {"plain", "oracle"}:
        raise SystemExit("--drafter is required with --target (or use --methods plain,oracle)")
    prompts = _prompts(args)
    results = {}
    oracle_file = workdir / "oracle-table.json"
    for method in ["plain"] + [m for m in methods if m != "plain"]:
        job = {"engine": _engine_kwargs(args, method, str(oracle_file)), "prompts": prompts,
               "max_tokens": args.max_tokens + (args.depth + 1 if method == "plain" else 0),
               "concurrency": args.concurrency}
        results[method] = run_engine(job, workdir, method)
        if method == "plain":
            oracle_file.write_text(json.dumps({"depth": args.depth, "continuations": [
                [p, o] for p, o in zip(prompts, results["plain"]["outputs"])]}))
            for level in results["plain"]["levels"].values():   # count the first max_tokens
                level["tokens"] = level["tokens"] * args.max_tokens / (args.max_tokens +
                                                                       args.depth + 1)
    print(f"\nvLLM {args.dtype} on CPU, {len(prompts)} requests x {args.max_tokens} tokens, "
          f"tree budget {args.budget} (oracle {2 * args.depth}), width {args.width}, "
          f"top-k {args.topk}")
    print(f"{'method':<9} {'conc':>4} {'tok/s':>8} {'vs plain':>8} {'tau':>6}  time in the "
          "dartree worker")
    for method in methods:
        for c in args.concurrency:
            lv = results[method]["levels"][str(c)]
            base = results["plain"]["levels"][str(c)]
            rate = lv["tokens"] / lv["seconds"]
            ratio = rate / (base["tokens"] / base["seconds"])
            tau = f"{lv['tau']:.2f}" if lv["tau"] else "-"
            stages = ", ".join(f"{k} {lv['stages'][k] / lv['seconds']:.0%}"
                               for k in ("target", "draft", "walk", "compaction")
                               if k in lv["stages"])
            print(f"{method:<9} {c:>4} {rate:>8.1f} {ratio:>7.2f}x {tau:>6}  {stages}")


if __name__ == "__main__":
    main()
