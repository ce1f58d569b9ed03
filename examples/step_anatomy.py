"""Where an engine's decode steps spend their time, stage by stage, stock vLLM or dartree.

    python examples/step_anatomy.py --method plugin-plain --concurrency 1
    python examples/step_anatomy.py --method plain --concurrency 1

SmolLM2-135M-Instruct (and the shipped drafter) on the demo prompts (or `--datasets`), 48
tokens each (`--max-tokens`), greedy,
the engine in this process. vLLM's runner and attention methods are wrapped with timers (a
few microseconds each, the same for every method), and per engine-core iteration the script
records: the whole iteration (`core`), `execute_model` (`exec`) and in it the inputs
(`prep`), the attention metadata (`meta`), the model forward (`fwd`) and in that the
attention layers (`attn`) and KV writes (`kvw`), then `sample_tokens` (`sample`) and in it
the tree walk (`walk`) and the propose stage (`propose`: dartree's planning, lookup, context
and drafting). It prints the mean milliseconds per kind of step and rows: `plain` (no draft),
`chain` (drafts that form one path, verified as causal rows by vLLM's own attention: a
lookup chain, or a tree cut to a path) and `tree` (drafts with branches, under tree masks).
Run two methods one after the other to compare them (this machine drifts: repeat them).
`--profile N` adds a cProfile of the propose stage (its N costliest calls, cumulative).
`plugin-plain` is dartree forced to plain steps (`VLLM_DARTREE_PLAIN=1`).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).parent))

STAGES = ("core", "exec", "prep", "meta", "fwd", "attn", "kvw", "sample", "walk", "propose")


def _install_timers(record: list[dict]) -> None:
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.engine import core
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_dartree.engine import cpu_attention, drafting, runner, tree_sampler
    current: dict = {}

    def timed(cls, name: str, stage: str) -> None:
        inner = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(self, *args, **kwargs)
            finally:
                current[stage] = current.get(stage, 0.0) + time.perf_counter() - start
        setattr(cls, name, wrapper)

    for cls, name, stage in (
            (GPUModelRunner, "execute_model", "exec"), (GPUModelRunner, "sample_tokens", "sample"),
            (GPUModelRunner, "propose_draft_token_ids", "propose"),
            (GPUModelRunner, "_build_attention_metadata", "meta"),
            (GPUModelRunner, "_model_forward", "fwd"),
            (cpu_attn.CPUAttentionBackendImpl, "forward", "attn"),
            (cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update", "kvw"),
            (cpu_attention.DARTreeCPUAttentionImpl, "forward", "attn"),
            (cpu_attention.DARTreeCPUAttentionImpl, "do_kv_cache_update", "kvw"),
            (drafting.DraftingMixin, "propose_draft_token_ids", "propose"),
            (tree_sampler.TreeSamplerMixin, "_sample", "walk")):
        timed(cls, name, stage)

    prepare = GPUModelRunner._prepare_inputs

    def prepare_inputs(self, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        try:
            return prepare(self, scheduler_output, *args, **kwargs)
        finally:
            current["prep"] = time.perf_counter() - start
            current["rows"] = scheduler_output.total_num_scheduled_tokens
            spec = scheduler_output.scheduled_spec_decode_tokens or {}
            current["kind"] = "chain" if any(spec.values()) else "plain"
    GPUModelRunner._prepare_inputs = prepare_inputs

    dartree_prepare = runner.DARTreeRunnerMixin._prepare_inputs

    def tree_flag(self, *args, **kwargs):
        out = dartree_prepare(self, *args, **kwargs)
        step = self._dt_step
        if step is not None and any(step.is_tree):
            current["kind"] = "tree"
        return out
    runner.DARTreeRunnerMixin._prepare_inputs = tree_flag

    engine_step = core.EngineCore.step

    def step(self, *args, **kwargs):
        current.clear()
        start = time.perf_counter()
        out = engine_step(self, *args, **kwargs)
        current["core"] = time.perf_counter() - start
        record.append(dict(current))
        return out
    core.EngineCore.step = step


def _profile_propose():
    """A cProfile that records every call of the propose stage (`--profile`)."""
    import cProfile

    from vllm_dartree.engine import drafting
    profile = cProfile.Profile()
    inner = drafting.DraftingMixin.propose_draft_token_ids

    def profiled(self, *args, **kwargs):
        profile.enable()
        try:
            return inner(self, *args, **kwargs)
        finally:
            profile.disable()
    drafting.DraftingMixin.propose_draft_token_ids = profiled
    return profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="plugin-plain",
                        choices=["plain", "plugin-plain", "dartree", "ngram"])
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the prompts")
    parser.add_argument("--datasets", default="gsm8k,humaneval,mt-bench",
                        help="prompt sets, as engine_bench's (code-edit,summary: the "
                             "repetitive set)")
    parser.add_argument("--per-dataset", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32", help="the target's dtype")
    parser.add_argument("--max-rows", type=int, default=80,
                        help="iterations with more scheduled tokens count as prefills")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile the propose stage (cProfile) and print its N "
                             "costliest functions")
    args = parser.parse_args()
    if args.method == "plugin-plain":
        os.environ["VLLM_DARTREE_PLAIN"] = "1"
    record: list[dict] = []
    _install_timers(record)

    import engine_bench
    from vllm import LLM, SamplingParams

    bench = engine_bench.smollm2_args(args.datasets, args.per_dataset, args.dtype)
    prompts = [{"prompt_token_ids": p} for p in engine_bench._prompts(bench)]
    method = "dartree" if args.method == "plugin-plain" else args.method
    llm = LLM(**engine_bench._engine_kwargs(bench, method, None))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)     # warm-up
    record.clear()
    profile = _profile_propose() if args.profile else None
    start = time.perf_counter()
    for _ in range(args.repeats):
        for i in range(0, len(prompts), args.concurrency):
            llm.generate(prompts[i:i + args.concurrency], params, use_tqdm=False)
    wall = time.perf_counter() - start

    steps = collections.defaultdict(list)
    for it in record:
        if 0 < it.get("rows", 0) <= args.max_rows and "exec" in it:
            steps[(it.get("kind", "plain"), it["rows"])].append(it)
    prefills = [it for it in record if it.get("rows", 0) > args.max_rows]
    print(f"\n{args.method}, concurrency {args.concurrency}, {args.repeats} round(s): "
          f"{wall:.2f} s wall, {sum(it['core'] for it in prefills):.2f} s in "
          f"{len(prefills)} iterations of more than {args.max_rows} rows (prefills: "
          + ", ".join(f"{s} {sum(it.get(s, 0.0) for it in prefills):.2f}" for s in STAGES[1:])
          + " s); mean ms per decode iteration:")
    print(f"{'kind':6s} {'rows':>4s} {'steps':>5s} " + " ".join(f"{s:>7s}" for s in STAGES))
    order = {"plain": 0, "chain": 1, "tree": 2}
    for (kind, rows), its in sorted(steps.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        if len(its) < 3:
            continue
        means = [1000 * statistics.mean(it.get(s, 0.0) for it in its) for s in STAGES]
        print(f"{kind:6s} {rows:4d} {len(its):5d} "
              + " ".join(f"{m:7.2f}" for m in means))
    if profile is not None:
        import pstats
        print("\nthe propose stage, cProfile (cumulative seconds over the run):")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
