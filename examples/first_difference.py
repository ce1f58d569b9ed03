"""Where DARTree's greedy answers first differ from plain decoding's, and whether it is a tie.

    python examples/first_difference.py --dtype bfloat16

SmolLM2-135M-Instruct and the shipped drafter on the demo prompts (or `--datasets`), each
prompt decoded alone (one request in flight), greedy, `--max-tokens` tokens: first by
DARTree (the defaults), in a child process, then by plain decoding here. For every prompt
whose answers differ it prints the first position where they do, both tokens, and the
target's top logprobs there (the plain engine after the common prefix). In fp32 the answers
are identical (the lossless tests); in bf16 a step's numerics depend on how many rows it
computes, so plain decoding's own answers change with the batch, and a difference between
two tokens at equal logprobs (or one bf16 step apart) is that, not a bug.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, str(Path(__file__).parent))


def _answers(llm, prompts, max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                 .outputs[0].token_ids) for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", help="the target's dtype")
    parser.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    parser.add_argument("--per-dataset", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dartree-out", help=argparse.SUPPRESS)   # the child's answers
    args = parser.parse_args()

    import engine_bench
    from vllm import LLM, SamplingParams
    bench = engine_bench.smollm2_args(args.datasets, args.per_dataset, args.dtype, 1)
    prompts = engine_bench._prompts(bench)
    if args.dartree_out:              # the child: DARTree's answers, then exit
        llm = LLM(**engine_bench._engine_kwargs(bench, "dartree", None))
        Path(args.dartree_out).write_text(json.dumps(_answers(llm, prompts, args.max_tokens)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dartree.json"
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--dartree-out", str(out)],
                       check=True)
        ours = json.loads(out.read_text())
    llm = LLM(**engine_bench._engine_kwargs(bench, "plain", None))
    base = _answers(llm, prompts, args.max_tokens)
    top = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    same = 0
    for i, (a, b) in enumerate(zip(base, ours)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            same += 1
            continue
        out = llm.generate([{"prompt_token_ids": prompts[i] + a[:k]}], top,
                           use_tqdm=False)[0].outputs[0]
        best = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1].logprob)[:3]
        print(f"prompt {i}: first difference at token {k}: plain {a[k]}, dartree {b[k]}; "
              "the target's top logprobs there: "
              + ", ".join(f"{t} {v.logprob:.4f}" for t, v in best), flush=True)
    print(f"{same} of {len(prompts)} answers identical ({args.dtype})")


if __name__ == "__main__":
    main()
