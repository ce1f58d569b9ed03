"""Command line of the reference decoder.

    python -m vllm_dartree.reference --target DIR --drafter DIR --method dartree-pruned \\
        --prompts prompts.jsonl [--budget 64 --width 12 --topk 64 --depth-bonus -0.2] \\
        [--temperature 0 --max-new-tokens 256 --limit N --save-outputs out.jsonl --json]

`--method` takes a comma-separated list (e.g. `ar,ddtree,dartree-pruned`): every method runs
on the same prompts in one process, and when `ar` is among them the speedup over it is printed
(tokens per second, measured in the same run). The prompt file has one JSON object per line
with a `prompt` field; prompts go through the target's chat template when it has one.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from vllm_dartree.prompts import PromptFileError, read_prompt_ids
from vllm_dartree.reference.decoder import (
    METHODS,
    DrafterSession,
    ReferenceDecoder,
    SamplingParams,
    eos_token_ids,
    load_drafter_for,
    method_config,
)
from vllm_dartree.reference.stats import format_summary, summarize

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_dartree.reference",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="Hugging Face model folder of the target")
    p.add_argument("--drafter", help="drafter checkpoint folder (all methods but 'ar')")
    p.add_argument("--method", default="dartree-pruned",
                   help=f"comma-separated, from: {', '.join(METHODS)}")
    p.add_argument("--prompts", required=True, help="JSONL file with a 'prompt' per line")
    p.add_argument("--limit", type=int, help="use the first N prompts")
    p.add_argument("--budget", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--topk", type=int)
    p.add_argument("--depth-bonus", type=float)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--save-outputs", help="write one JSON line per request and method here")
    p.add_argument("--json", action="store_true", help="print the summaries as JSON")
    return p


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = _parser().parse_args(argv)
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    overrides = dict(budget=args.budget, width=args.width, topk=args.topk,
                     depth_bonus=args.depth_bonus)
    configs = {m: method_config(m, **overrides) for m in methods}
    if any(c is not None for c in configs.values()) and not args.drafter:
        raise SystemExit("--drafter is required for every method except 'ar'")
    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafter = load_drafter_for(target, args.drafter, dtype) if args.drafter else None
    try:
        _, prompts = read_prompt_ids(args.prompts, tokenizer, not args.no_chat_template,
                                     args.limit)
    except PromptFileError as err:
        raise SystemExit(str(err)) from None
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            eos_token_ids=eos_token_ids(target, tokenizer))
    saved = open(args.save_outputs, "w") if args.save_outputs else None
    summaries = {}
    for method, config in configs.items():
        results = []
        for i, prompt in enumerate(tqdm(prompts, desc=method, file=sys.stderr)):
            session = DrafterSession(drafter) if config is not None else None
            res = ReferenceDecoder(target, session, config).generate(prompt, params)
            results.append(res)
            if saved:
                saved.write(json.dumps({"method": method, "index": i, "tau": res.tau,
                                        "output": tokenizer.decode(res.output_tokens),
                                        "output_tokens": res.output_tokens}) + "\n")
        summaries[method] = summarize(method, results)
        print(format_summary(summaries[method], args.json), flush=True)
    if "ar" in summaries and summaries["ar"].tokens_per_second:
        base = summaries["ar"].tokens_per_second
        for method, summary in summaries.items():
            print(f"speedup over ar  {method}: {summary.tokens_per_second / base:.2f}x")
    if saved:
        saved.close()


if __name__ == "__main__":
    main()
