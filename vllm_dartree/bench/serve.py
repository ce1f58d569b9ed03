"""vLLM's own serving benchmark (`vllm bench serve`) against plain, `ngram` and dartree servers.

    python -m vllm_dartree.bench.serve --smollm2                 # SmolLM2 + shipped drafter
    python -m vllm_dartree.bench.serve --target DIR --drafter DIR
        [--methods plain,ngram,dartree] [--concurrency 1,4] [--num-prompts 18]
        [--max-tokens 64] [--datasets gsm8k,humaneval,mt-bench] [--out results.json]

For each method in turn: starts `vllm serve` with the plugin on a loopback port (the same
flags for every method; only `--speculative-config` differs), runs `vllm bench serve` (vLLM's
client, through this package's CLI shim, since the CPU wheel's `vllm` command fails at
start) once per concurrency level on the same prompts, in chat format, greedy
(`--temperature 0`), every request sent at once and at most `concurrency` in flight,
and stops the server. Prints vLLM's numbers side by side (request throughput, output
tokens/s, TTFT / TPOT / ITL median and p99) with each method's output tokens/s relative to
plain's at the same concurrency, and saves vLLM's result files under `--workdir`.
Resumable: a finished (method, concurrency) result file is read back, not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_dartree.bench.load import Server

__all__ = ["METHODS", "spec_for", "main"]

METHODS = ("plain", "ngram", "dartree", "dartree-fixed")
COLUMNS = (("request_throughput", "req/s", "{:.2f}"), ("output_throughput", "out tok/s", "{:.1f}"),
           ("median_ttft_ms", "TTFT p50 ms", "{:.0f}"), ("p99_ttft_ms", "TTFT p99 ms", "{:.0f}"),
           ("median_tpot_ms", "TPOT p50 ms", "{:.0f}"), ("p99_tpot_ms", "TPOT p99 ms", "{:.0f}"),
           ("median_itl_ms", "ITL p50 ms", "{:.0f}"),
           ("spec_decode_acceptance_length", "tau", "{:.2f}"))


def spec_for(method: str, drafter: str) -> dict | None:
    """The server's --speculative-config for a method (None: plain decoding)."""
    if method == "plain":
        return None
    if method == "ngram":   # vLLM's prompt lookup, as in examples/engine_bench.py
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
    if method == "dartree":
        return {"method": "dartree", "model": drafter}
    if method == "dartree-fixed":   # the paper's fixed 64-node tree every round
        return {"method": "dartree", "model": drafter, "adaptive": False}
    raise ValueError(f"unknown method {method!r}; choose from {list(METHODS)}")


def write_dataset(path: Path, datasets: list[str], per_dataset: int) -> int:
    """The benchmark prompts as vLLM's `custom` dataset (JSONL with a `prompt` field)."""
    from vllm_dartree.bench.datasets import load_prompts
    rows = [q.prompt for name in datasets for q in load_prompts(name, per_dataset)]
    path.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    return len(rows)


def bench_command(port: int, model: str, tokenizer: str, dataset: Path, num_prompts: int,
                  concurrency: int, max_tokens: int, result_dir: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "vllm_dartree.engine.cli", "bench", "serve",
            "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--num-prompts", str(num_prompts), "--disable-shuffle",
            "--custom-output-len", str(max_tokens), "--temperature", "0",
            "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", name]


def table(results: dict, methods: list[str], levels: list[int]) -> str:
    head = ["method", "concurrency", *(label for _, label, _ in COLUMNS), "vs plain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in levels:
        base = results.get(("plain", c), {}).get("output_throughput")
        for m in methods:
            r = results.get((m, c))
            if r is None:
                continue
            cells = [fmt.format(r[key]) if r.get(key) is not None else "-"
                     for key, _, fmt in COLUMNS]
            ratio = f"{r['output_throughput'] / base:.2f}x" if base else "-"
            lines.append(f"| {m} | {c} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.bench.serve",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--smollm2", action="store_true",
                        help="target = SmolLM2-135M-Instruct, drafter = the shipped one")
    parser.add_argument("--methods", default="plain,ngram,dartree")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    parser.add_argument("--per-dataset", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--workdir", type=Path, default=Path("serve-bench"))
    parser.add_argument("--out", type=Path, help="all results as JSON")
    args = parser.parse_args(argv)
    if args.smollm2:
        from vllm_dartree.zoo.shipped import smollm2_pair
        args.target, args.drafter = smollm2_pair(args.target, args.drafter)
    methods = args.methods.split(",")
    for m in methods:
        spec_for(m, "")   # an unknown method fails here, before any server starts
    if not args.target or (not args.drafter and set(methods) & {"dartree", "dartree-fixed"}):
        parser.error("give --target and --drafter, or --smollm2")
    levels = [int(c) for c in args.concurrency.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    dataset = args.workdir / "prompts.jsonl"
    num_prompts = write_dataset(dataset, args.datasets.split(","), args.per_dataset)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    results: dict[tuple[str, int], dict] = {}
    for method in methods:
        names = {c: f"{method}-c{c}.json" for c in levels}
        todo = [c for c in levels if not (args.workdir / names[c]).exists()]
        if todo:
            print(f"{method}: starting the server", file=sys.stderr)
            server = Server(args.target, spec_for(method, args.drafter),
                            args.workdir / f"{method}.log", args.max_model_len, max(levels))
            try:
                for c in todo:
                    print(f"{method}: vllm bench serve, {num_prompts} prompts, at most {c} in "
                          "flight", file=sys.stderr)
                    proc = subprocess.run(
                        bench_command(server.port, server.model, args.target, dataset,
                                      num_prompts, c, args.max_tokens, args.workdir, names[c]),
                        env=env, capture_output=True, text=True)
                    if proc.returncode != 0:
                        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n"
                                           + proc.stderr[-3000:])
            finally:
                server.stop()
        for c in levels:
            results[(method, c)] = json.loads((args.workdir / names[c]).read_text())
    print(table(results, methods, levels))
    if args.out:
        args.out.write_text(json.dumps({f"{m}@{c}": r for (m, c), r in results.items()},
                                       indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
