"""Output tokens per second in vLLM: plain decoding vs DARTree vs the DDTree and chain
builders (same drafter), at several concurrencies, measured in one run.

    python examples/engine_bench.py                      # tiny random models, written here
    python examples/engine_bench.py --target DIR --drafter DIR [--prompts FILE.jsonl]

Each method runs in its own engine process (one vLLM engine per process); inside it, every
concurrency level c runs the same requests with c of them in flight (a finished request is
replaced at once, as `vllm bench serve --max-concurrency c` does; at least 2c requests, the
prompts repeated in order) and times them after a warm-up.
Printed per method and level: output tokens/s, the ratio to plain decoding at that level,
tau (vLLM's mean acceptance length, over the steps that drafted), tokens per decode step
of a request (`tok/step`: over every step, the comparable number), and the share of the
wall time the dartree worker spent in the target's forward (`execute_model`), drafting,
the tree walk and KV compaction.
`fixed-N` / `oracle-N` are those with a fixed budget N (`oracle-N`: the oracle's chain and
distractors cut at N nodes, depth N / 2 at most). `oracle` is a drafter that knows the
target's greedy continuation (tau = depth + 1, a fixed budget): the ceiling that tree
verification reaches in this engine when the drafter is right; `oracle-adaptive` the same
drafter under the adaptive budget.
`plugin-plain` is the dartree engine with every step plain (`VLLM_DARTREE_PLAIN=1`): what
the plugin's worker and attention cost by themselves. `ngram` is vLLM's own prompt-lookup
speculation. `fixed` is DARTree verifying `budget` nodes every round (`adaptive: false`).
`dartree-nolookup` is DARTree (adaptive) without lookup branches (`lookup: false`);
`dartree-match5` trusts a lookup continuation by its n-gram order alone
(`lookup_max_match: 5`, as before the match's full extent was measured).
`dartree-bf16-drafter` runs the drafter's backbone in bfloat16 on a CPU with AMX
(`drafter_dtype: auto`, its head in the target's dtype), `dartree-bf16` the whole drafter
on any CPU, `dartree-model-dtype` the whole drafter in the target's dtype.
`dartree-nocompete` plans drafter nodes beside lookup branches as if they did not compete
for the root (`VLLM_DARTREE_COMPETE=0`, how the budget planned before).
`dartree-conf` is DARTree (the defaults) planning with the target's confidence too
(`VLLM_DARTREE_CONFIDENCE=1`, an opt-in experiment).
`dartree-alt` is DARTree (the defaults) with the drafter of `--alt-drafter`, to compare two
drafters in one run. `plain-sync` is plain decoding without vLLM's async scheduling, which
vLLM turns off for every speculative method it does not list (dartree's `custom_class`
carrier, and `ngram` on CPU): the baseline those engines actually share.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Every engine's KV cache, fixed: vLLM's CPU default (a share of NUMA node 0's memory, less
# the process) left nothing for it on a machine whose node 0 holds 10 GiB, and the engines
# of one run live side by side. 512 MiB is about 11,000 SmolLM2 tokens in fp32.
KV_CACHE_BYTES = 512 << 20

METHODS = ("plain", "dartree", "ddtree", "chain", "oracle")
EXTRA_METHODS = ("plugin-plain", "ngram", "fixed", "oracle-adaptive", "dartree-nolookup",
                 "dartree-alt", "plain-sync", "dartree-conf", "dartree-match5",
                 "dartree-bf16-drafter", "dartree-bf16", "dartree-model-dtype",
                 "dartree-nocompete")


def smollm2_args(datasets: str, per_dataset: int, dtype: str = "float32",
                 concurrency: int = 16) -> argparse.Namespace:
    """This script's options for SmolLM2 and the shipped drafter with the README's tree
    settings, in one process: what the other examples build engines and prompts from."""
    from vllm_dartree.zoo.shipped import smollm2_pair
    args = argparse.Namespace(smollm2=True, datasets=datasets, per_dataset=per_dataset,
                              prompts=None, budget=64, width=12, topk=64, depth=8, dtype=dtype,
                              concurrency=[concurrency], ngram_k=4, alt_drafter=None,
                              in_process=True)
    args.target, args.drafter = smollm2_pair()
    return args


def _engine_kwargs(args, method: str, oracle_file: str | None) -> dict:
    """vLLM kwargs of a method; `fixed-N` / `oracle-N` are the fixed trees of budget N."""
    name, _, size = method.partition("-")
    budget = int(size) if size.isdigit() else args.budget
    if size.isdigit():
        method = name
    # prefix caching off for every engine: the plugin turns it off (cached prompt tokens
    # would give the drafter no target features), and plain / ngram engines that kept it
    # would skip the prefill of every prompt after the warm-up (each level and repeat sends
    # the same prompts): 12% of plain's time at 16 requests in one profile here
    kw = dict(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=1024,
              enable_prefix_caching=False,
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_num_seqs=max(args.concurrency), seed=0,
              disable_log_stats=False,
              max_num_batched_tokens=max(2048, max(args.concurrency) * (budget + 1)))
    if args.in_process:   # the worker in the engine's process too (on CPU vLLM defaults to a
        kw["distributed_executor_backend"] = "uni"   # worker process the engine core polls)
    tree = {"method": "dartree", "model": args.drafter, "budget": budget,
            "width": args.width, "topk": args.topk}
    if method in ("dartree", "ddtree", "chain"):
        kw["speculative_config"] = {**tree, "builder": method}
    elif method == "dartree-nolookup":
        kw["speculative_config"] = {**tree, "lookup": False}
    elif method == "dartree-match5":     # lookup's prior from the n-gram order alone
        kw["speculative_config"] = {**tree, "lookup_max_match": 5}
    elif method == "dartree-bf16-drafter":   # bfloat16 where the CPU has AMX
        kw["speculative_config"] = {**tree, "drafter_dtype": "auto"}
    elif method == "dartree-bf16":            # bfloat16 on any CPU
        kw["speculative_config"] = {**tree, "drafter_dtype": "bfloat16"}
    elif method == "dartree-model-dtype":     # the target's dtype
        kw["speculative_config"] = {**tree, "drafter_dtype": "model"}
    elif method == "plain-sync":
        kw["async_scheduling"] = False
    elif method == "dartree-alt":
        if not args.alt_drafter:
            raise SystemExit("dartree-alt needs --alt-drafter DIR")
        kw["speculative_config"] = {**tree, "model": args.alt_drafter}
    elif method in ("plugin-plain", "dartree-conf", "dartree-nocompete"):   # switch in env
        kw["speculative_config"] = tree
    elif method == "fixed":
        kw["speculative_config"] = {**tree, "adaptive": False}
    elif method == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram_k,
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    elif method in ("oracle", "oracle-adaptive"):
        kw["speculative_config"] = {**tree, "model": oracle_file,
                                    "budget": budget if size.isdigit() else 2 * args.depth,
                                    "adaptive": method == "oracle-adaptive",
                                    "drafter_class":
                                        "vllm_dartree.engine.drafters.OracleTreeDrafter"}
    return kw


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            out[m.name] = m.value
    return out


def _budget_delta(llm, before: dict) -> dict:
    """The adaptive budget's counters over one level (costs as fitted at its end)."""
    after = llm.collective_rpc("dartree_budget")[0]
    return {k: v - before.get(k, 0) if k in before and not k.startswith(("cost", "shrink")) else v
            for k, v in after.items()}


def budget_line(level: dict) -> str:
    """'plain 93% of steps, 4.1 nodes/tree, accepted/tree 0.61 predicted 0.58 observed'."""
    b = level.get("budget") or {}
    if not b.get("steps"):
        return ""
    rounds = max(b["rounds"], 1)
    return (f"plain {b['plain_steps'] / b['steps']:.0%} of steps, {b['nodes'] / rounds:.1f} "
            f"nodes/tree, accepted/tree {b['predicted_accepted'] / rounds:.2f} predicted "
            f"{b['observed_accepted'] / rounds:.2f} observed; row "
            f"{1e3 * b['cost_row_s']:.1f} ms (a tree node "
            f"{1e3 * b.get('cost_node_s', 0.0):+.1f}, a tree step "
            f"+{1e3 * b.get('cost_tree_step_s', 0.0):.1f}"
            + (f", {1e3 * b['cost_excess_row_s']:+.1f} a row past {b['cost_knee_rows']:.0f}"
               if b.get("cost_knee_rows", -1) >= 0 else "")
            + (f", a new row count +{1e3 * b['cost_new_rows_s']:.1f} once"
               if "cost_new_rows_s" in b else "") + "), "
            f"step {1e3 * b['cost_step_s']:.1f} ms, draft "
            f"{1e3 * b['cost_draft_s']:.1f} + {1e3 * b['cost_draft_request_s']:.1f}/req + "
            f"{1e3 * b['cost_draft_depth_s']:.2f}/req/depth ms" + (
                f"; lookup nodes {b['lookup_accepted']}/{b['lookup_nodes']} accepted, shared "
                f"{b['shared_accepted']}/{b['shared_nodes']}; lookup found continuations for "
                f"{b.get('lookup_offered', 0)} request-steps, verified in "
                f"{b.get('lookup_offered_planned', 0)}" if b.get("lookup_nodes") or
                b.get("shared_nodes") else ""))


PROTOCOL = "@@bench "   # the engine's replies on stdout (vLLM logs there too)


_LEVELS = itertools.count()


def generate_in_flight(llm, prompts, params, c: int) -> list:
    """The prompts' outputs (in their order) with c requests in flight: each finished request
    is replaced by the next prompt at once, as a client with `--max-concurrency c` does
    (`vllm bench serve`). Sending them c at a time instead (one `generate` per group) makes
    every group wait for its slowest request, which charges a speculative method for the
    spread of its requests' speeds: the last steps of a group run one or two requests."""
    from vllm.sampling_params import RequestOutputKind
    engine, level = llm.llm_engine, next(_LEVELS)
    params = params.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    waiting = list(range(len(prompts)))[::-1]
    running: dict[str, int] = {}
    outputs: list = [None] * len(prompts)

    def admit() -> None:
        i = waiting.pop()
        name = f"bench-{level}-{i}"
        running[name] = i
        running[engine.add_request(name, prompts[i], params)] = i

    for _ in range(min(c, len(waiting))):
        admit()
    while any(o is None for o in outputs):
        for out in engine.step():
            if out.finished and out.request_id in running:
                i = running[out.request_id]
                if outputs[i] is None:
                    outputs[i] = out
                    if waiting:
                        admit()
    return outputs


def _run_level(llm, prompts, params, c: int, spec: bool, strict: bool = True) -> dict:
    """Run the prompts with c in flight, timed; the level's tokens/s inputs, tau and
    counters. `strict`: a repeated prompt must answer as it did (fp32; in bf16 a step's
    numerics depend on its batch, plain decoding's too, so differences are counted)."""
    before = _counters(llm)
    budget_before = llm.collective_rpc("dartree_budget")[0] if spec else {}
    if spec:
        llm.collective_rpc("dartree_seconds", kwargs={"reset": True})
    # at least 2c requests (the prompts again, in order), so that c stay in flight for most
    # of the level and not only at its start
    requests = [prompts[i % len(prompts)] for i in range(max(len(prompts), 2 * c))]
    start = time.perf_counter()
    outputs = generate_in_flight(llm, requests, params, c)
    seconds = time.perf_counter() - start
    answers = [list(o.outputs[0].token_ids) for o in outputs]
    differ = 0
    for i in range(len(prompts), len(requests)):
        if answers[i] != answers[i % len(prompts)]:
            if strict:
                raise SystemExit(f"prompt {i % len(prompts)}: a repeat answered differently: "
                                 "a bug")
            differ += 1
    after = _counters(llm)
    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
        "vllm:spec_decode_num_drafts", 0)
    accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0)
    return {"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "drafts": drafts, "accepted": accepted, "requests": len(requests),
            "stages": llm.collective_rpc("dartree_seconds")[0] if spec else {},
            "budget": _budget_delta(llm, budget_before) if spec else {},
            "outputs": answers[:len(prompts)], "repeats_differ": differ}


def serve(job_path: str) -> None:
    """One engine, driven over stdin: a line {"concurrency": c} runs a level and answers one
    PROTOCOL line of JSON; {"quit": true} ends it."""
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(**job["engine"])
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0,
                            ignore_eos=job.get("ignore_eos", True))
    llm.generate(prompts[:2], params, use_tqdm=False)     # warm-up
    spec = (job["engine"].get("speculative_config") or {}).get("method") == "dartree"
    print(PROTOCOL + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        level_params = params
        if "max_tokens" in command:
            level_params = SamplingParams(max_tokens=int(command["max_tokens"]),
                                          temperature=0.0, ignore_eos=params.ignore_eos)
        level = _run_level(llm, prompts, level_params, int(command["concurrency"]), spec,
                           strict=job["engine"].get("dtype") == "float32")
        print(PROTOCOL + json.dumps(level), flush=True)


class EngineSession:
    """An engine process kept alive between levels, so that every method's levels can be
    interleaved: the machine's drift (shared, noisy) then hits all methods alike."""

    def __init__(self, name: str, job: dict, workdir: Path, env: dict | None = None):
        self.name = name
        path = workdir / f"{name}.json"
        path.write_text(json.dumps(job))
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", "nobind"), TOKENIZERS_PARALLELISM="false",
            **(env or {}))
        self.log = open(workdir / f"{name}.log", "w")
        print(f"[{name}] starting the engine ...", flush=True)
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(path)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self._reply()

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL):
                return json.loads(line[len(PROTOCOL):])
        self.log.flush()
        tail = Path(self.log.name).read_text()[-4000:]
        raise SystemExit(f"[{self.name}] the engine stopped:\n{tail}")

    def run(self, concurrency: int, max_tokens: int | None = None) -> dict:
        command = {"concurrency": concurrency}
        if max_tokens is not None:
            command["max_tokens"] = max_tokens
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)
        self.log.close()


def per_step(level: dict) -> float | None:
    """Output tokens per decode step of a request: tau counted over every step, the steps
    without a draft too (vLLM's tau counts only the steps that drafted: `ngram` drafts only
    where its n-gram matches). Each request's first token comes from its prefill; the rest
    from steps that each give one token plus the drafts they accept. vLLM counts what a
    request's last step accepted past `max_tokens` too, so this reads a little high, and
    where the last steps accept much (the oracle) it cannot be told: None, printed "-"."""
    steps = level["tokens"] - level["accepted"] - level["requests"]
    return (level["tokens"] - level["requests"]) / steps if steps > 0 else None


def repeat_spread(level: dict, base: dict) -> str:
    """The lowest and highest of a level's ratios to plain decoding, repeat by repeat (each
    repeat's against plain's in the same repeat, interleaved, so the machine's drift hits
    both): how far one repeat can be from another. '-' for one repeat."""
    ours, plain = level.get("repeat_rates", []), base.get("repeat_rates", [])
    if len(ours) < 2 or len(ours) != len(plain):
        return "-"
    ratios = [a / b for a, b in zip(ours, plain)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def run_interleaved(sessions: dict[str, EngineSession], levels: list[int],
                    repeats: int = 2, strict: bool = True) -> dict:
    """Every (method, level) `repeats` times, methods in rotating order inside each level;
    per method and level the summed tokens and seconds, each repeat's tokens/s, tau, the
    stages and budget counters of the last repeat, and the outputs (checked identical across
    repeats)."""
    names = list(sessions)
    results = {n: {"levels": {}, "outputs": {}} for n in names}
    for rep in range(repeats):
        for c in levels:
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                time.sleep(1.5)   # the last engine's workers stop spinning after 1 s idle
                lv = sessions[name].run(c)
                acc = results[name]["levels"].setdefault(
                    str(c), {"seconds": 0.0, "tokens": 0, "drafts": 0, "accepted": 0,
                             "requests": 0})
                for key in ("seconds", "tokens", "drafts", "accepted", "requests"):
                    acc[key] += lv[key]
                acc.setdefault("repeat_rates", []).append(lv["tokens"] / lv["seconds"])
                acc["tau"] = 1 + acc["accepted"] / acc["drafts"] if acc["drafts"] else None
                acc["per_step"] = per_step(acc)
                acc["stages"], acc["budget"] = lv["stages"], lv["budget"]
                acc["stage_seconds"] = lv["seconds"]
                # per level: in bf16 (not batch-invariant) plain decoding's own outputs
                # depend on the batch, so only the repeats of one level must agree
                seen = results[name]["outputs"].setdefault(str(c), lv["outputs"])
                if seen != lv["outputs"] and strict:
                    raise SystemExit(f"[{name}] outputs changed between runs: a bug")
                acc["repeats_differ"] = acc.get("repeats_differ", 0) + lv.get(
                    "repeats_differ", 0) + sum(a != b for a, b in zip(seen, lv["outputs"]))
            print(f"  repeat {rep + 1}/{repeats}, concurrency {c}: done", flush=True)
    return results


def outputs_differ(results: dict, name: str, level: int) -> int:
    """How many of `name`'s outputs at concurrency `level` differ from plain decoding's
    (`run_interleaved`'s results: outputs per level, one token-id list per prompt)."""
    ours, base = results[name]["outputs"][str(level)], results["plain"]["outputs"][str(level)]
    if len(ours) != len(base):
        raise ValueError(f"{name} at concurrency {level}: {len(ours)} outputs for "
                         f"{len(base)} prompts")
    return sum(a != b for a, b in zip(ours, base))


def _prompts(args) -> list[list[int]]:
    if args.datasets:
        from transformers import AutoTokenizer

        from vllm_dartree.bench.datasets import chat_prompt_ids, load_prompts
        from vllm_dartree.bench.repetitive import REPETITIVE, repetitive_prompts
        tok = AutoTokenizer.from_pretrained(args.target)
        load = lambda name: (repetitive_prompts if name in REPETITIVE  # noqa: E731
                             else load_prompts)(name, args.per_dataset)
        return [chat_prompt_ids(tok, q.prompt) for name in args.datasets.split(",")
                for q in load(name)]
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
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2,
                        help="interleaved repeats of every (method, level)")
    parser.add_argument("--target", help="target model folder (default: tiny random Qwen3)")
    parser.add_argument("--drafter", help="drafter folder (default: tiny random Domino; with "
                        "--smollm2, the shipped drafter)")
    parser.add_argument("--alt-drafter", help="a second drafter folder, for `dartree-alt`")
    parser.add_argument("--prompts", help="JSONL file with {'prompt': text} lines")
    parser.add_argument("--datasets", help="benchmark prompt sets instead (e.g. "
                        "gsm8k,humaneval,mt-bench: vllm_dartree.bench.datasets; the "
                        "repetitive code-edit,summary: vllm_dartree.bench.repetitive)")
    parser.add_argument("--per-dataset", type=int, default=2)
    parser.add_argument("--smollm2", action="store_true", help="target = SmolLM2-135M-Instruct"
                        " (prepared offline), drafter = the one shipped for it")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"any of {METHODS + EXTRA_METHODS}")
    parser.add_argument("--ngram-k", type=int, default=4, help="ngram's draft tokens")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--depth", type=int, default=8, help="oracle tree depth")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--in-process", action="store_true",
                        help="every engine in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                             "and the uni executor): no front-end, engine-core or worker "
                             "processes competing for the cores")
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="dartree-bench-"))
    if args.smollm2:
        from vllm_dartree.zoo.shipped import smollm2_pair
        args.target, shipped = smollm2_pair()
        args.drafter = args.drafter or shipped
    if not args.target:
        from vllm_dartree.testing import write_tiny_drafter, write_tiny_target
        args.target = str(write_tiny_target(workdir / "target", head_dim=32, seed=1))
        args.drafter = str(write_tiny_drafter(workdir / "domino", "domino", args.target))
    elif not args.drafter and set(methods) - {"plain", "oracle"}:
        raise SystemExit("--drafter is required with --target (or use --methods plain,oracle)")
    prompts = _prompts(args)
    oracle_file = workdir / "oracle-table.json"
    job = lambda m: {"engine": _engine_kwargs(args, m, str(oracle_file)),  # noqa: E731
                     "prompts": prompts, "max_tokens": args.max_tokens}
    common = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if args.in_process else {}
    sessions = {"plain": EngineSession("plain", job("plain"), workdir, common)}
    try:
        if any(m.startswith("oracle") for m in methods):   # the target's own continuations
            table = sessions["plain"].run(max(args.concurrency), args.max_tokens + args.depth + 1)
            oracle_file.write_text(json.dumps({"depth": args.depth, "continuations": [
                [p, o] for p, o in zip(prompts, table["outputs"])]}))
        for m in methods:
            if m != "plain":
                env = {**common, **({"VLLM_DARTREE_PLAIN": "1"} if m == "plugin-plain" else {}),
                       **({"VLLM_DARTREE_CONFIDENCE": "1"} if m == "dartree-conf" else {}),
                       **({"VLLM_DARTREE_COMPETE": "0"} if m == "dartree-nocompete" else {})}
                sessions[m] = EngineSession(m, job(m), workdir, env)
        results = run_interleaved(sessions, args.concurrency, args.repeats,
                                  strict=args.dtype == "float32")
    finally:
        for session in sessions.values():
            session.close()
    for m in methods:
        for c in args.concurrency:
            differ = outputs_differ(results, m, c)
            if differ:
                print(f"WARNING: {m}'s outputs differ from plain decoding's at concurrency "
                      f"{c} in {differ} of {len(results['plain']['outputs'][str(c)])} "
                      "requests", flush=True)
            if results[m]["levels"][str(c)].get("repeats_differ"):
                print(f"note: {m} at concurrency {c}: "
                      f"{results[m]['levels'][str(c)]['repeats_differ']} repeated prompts "
                      f"answered differently ({args.dtype} is not batch-invariant)", flush=True)
    print(f"\nvLLM {args.dtype} on CPU{' (engines in-process)' if args.in_process else ''}, "
          f"{len(prompts)} requests x {args.max_tokens} tokens, "
          f"tree budget {args.budget} (oracle {2 * args.depth}), width {args.width}, "
          f"top-k {args.topk}")
    print(f"{'method':<9} {'conc':>4} {'tok/s':>8} {'vs plain':>8} {'tau':>6} {'tok/step':>8}"
          f" {'repeats':>9}  time in the dartree worker")
    for method in ["plain"] + [m for m in methods if m != "plain"]:
        for c in args.concurrency:
            lv = results[method]["levels"][str(c)]
            base = results["plain"]["levels"][str(c)]
            rate = lv["tokens"] / lv["seconds"]
            ratio = rate / (base["tokens"] / base["seconds"])
            tau = f"{lv['tau']:.2f}" if lv["tau"] else "-"
            steps = f"{lv['per_step']:.2f}" if lv.get("per_step") else "-"
            stages = ", ".join(f"{k} {lv['stages'][k] / lv['stage_seconds']:.0%}"
                               for k in ("target", "draft", "walk", "compaction")
                               if k in lv["stages"])
            print(f"{method:<9} {c:>4} {rate:>8.1f} {ratio:>7.2f}x {tau:>6} {steps:>8} "
                  f"{'-' if method == 'plain' else repeat_spread(lv, base):>9}  {stages}")
            if budget_line(lv):
                print(f"{'':<14} {budget_line(lv)}")


if __name__ == "__main__":
    main()
