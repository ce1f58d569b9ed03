"""The paper's figures, measured here: PNGs and the JSON they were drawn from.

    python -m vllm_dartree.bench.figures                    # SmolLM2 + the shipped drafter
    python -m vllm_dartree.bench.figures --quick            # tiny random models (a smoke test)
        [--target DIR --drafter DIR] [--parts acceptance,sweeps,construction,throughput]
        [--per-dataset 2] [--max-new-tokens 48] [--out docs/figures] [--workdir DIR]

Parts (each a PNG under --out, its numbers in --out/figures.json, and its caption, which says
what was run, under the plot):

- `acceptance`: Pr(accepted length >= t) per depth t (paper Fig. 5) and the distributions of
  accepted length and of tree depth per method (Fig. 7), for the DFlash chain, DDTree, the
  Domino chain, DARTree fixed and pruned, in the reference decoder (batch 1, greedy).
- `sweeps`: tau of DARTree pruned against the width W, the depth bonus beta, top-K, and the
  budget B (DDTree beside it), one parameter at a time from the defaults (Figs. 4 / 6).
- `construction`: tree construction time per round at Qwen3-4B shapes, batch 1 and 8:
  batched DARTree (pruned, fixed) vs the sequential heap vs DDTree (Table 2), from
  `bench.construction`.
- `throughput`: output tokens/s against concurrency in vLLM (`vllm bench serve` through
  `bench.serve`): plain, vLLM's ngram, DARTree adaptive (the defaults) and fixed 64-node trees.

Resumable: every finished run is kept in --workdir (default bench_results/figures) and read
back. `--quick` runs every part but `throughput` (which starts vLLM servers) on tiny random
models with a few prompts, to check the whole path in the tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["PARTS", "Run", "measure", "main"]

PARTS = ("acceptance", "sweeps", "construction", "throughput")
CURVE_METHODS = (("dflash", "DFlash chain"), ("ddtree", "DDTree"), ("domino", "Domino chain"),
                 ("dartree-fixed", "DARTree fixed"), ("dartree-pruned", "DARTree pruned"))
SWEEPS = {   # parameter -> (values, the default it is swept from)
    "width": ((4, 8, 12, 16), 12),
    "depth_bonus": ((0.0, -0.1, -0.2, -0.5), -0.2),
    "topk": ((16, 64, 256, 512), 64),
    "budget": ((8, 16, 32, 64, 128), 64),
}
QUICK_SWEEPS = {"width": ((2, 4), 4), "depth_bonus": ((0.0, -0.2), -0.2),
                "topk": ((8, 16), 16), "budget": ((4, 8), 8)}
SWEEP_LABELS = {"width": "width W", "depth_bonus": "depth bonus beta", "topk": "top-K",
                "budget": "budget B (nodes per round)"}


@dataclass
class Run:
    """One method with one configuration over the prompt set (reference decoder, T = 0)."""
    name: str
    method: str
    overrides: dict
    tau: float
    acceptance_by_depth: list[float]     # Pr(L >= t), t = 1..
    accepted: dict[int, int]             # accepted length -> rounds
    tree_depths: dict[int, int]          # tree depth -> rounds
    rounds: int
    tokens_per_second: float


def measure(target, drafter, prompts, method: str, overrides: dict, max_new_tokens: int,
            eos: tuple[int, ...], name: str) -> Run:
    from tqdm import tqdm

    from vllm_dartree.reference import DrafterSession, ReferenceDecoder, SamplingParams
    from vllm_dartree.reference.decoder import method_config
    from vllm_dartree.reference.stats import summarize

    config = method_config(method, **overrides)
    results = []
    for prompt in tqdm(prompts, desc=name, file=sys.stderr, leave=False):
        params = SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=eos)
        results.append(ReferenceDecoder(target, DrafterSession(drafter), config)
                       .generate(prompt, params))
    s = summarize(method, results)
    rounds = [r for res in results for r in res.rounds]
    return Run(name, method, overrides, s.tau, s.acceptance_by_depth,
               dict(sorted(Counter(r.accepted for r in rounds).items())),
               s.tree_depths, len(rounds), s.tokens_per_second)


class Store:
    """Finished runs by name in WORKDIR/runs.jsonl (a cut-off run resumes), started over
    when the settings change."""

    def __init__(self, workdir: Path, settings: dict):
        workdir.mkdir(parents=True, exist_ok=True)
        self.path = workdir / "runs.jsonl"
        marker = workdir / "settings.json"
        if marker.exists() and json.loads(marker.read_text()) != settings:
            self.path.unlink(missing_ok=True)
        marker.write_text(json.dumps(settings, indent=2))
        self.items: dict[str, dict] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    item = json.loads(line)
                    self.items[item["key"]] = item["value"]

    def get(self, key: str, compute):
        if key not in self.items:
            value = compute()
            self.items[key] = value
            with open(self.path, "a") as f:
                f.write(json.dumps({"key": key, "value": value}) + "\n")
        return self.items[key]


# -- drawing -------------------------------------------------------------------------------
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path, caption: str) -> None:
    import textwrap
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(caption, 150)), fontsize=7, va="bottom",
             ha="left", color="#333333")
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def draw_acceptance(runs: dict[str, dict], path: Path, caption: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    fig.subplots_adjust(bottom=0.22, wspace=0.28, left=0.05, right=0.98, top=0.9)
    for method, label in CURVE_METHODS:
        r = runs.get(method)
        if r is None:
            continue
        curve = r["acceptance_by_depth"]
        axes[0].plot(range(1, len(curve) + 1), curve, marker="o", ms=3,
                     label=f"{label} (tau {r['tau']:.2f})")
        for ax, key in ((axes[1], "accepted"), (axes[2], "tree_depths")):
            hist = {int(k): v for k, v in r[key].items()}
            total = sum(hist.values()) or 1
            xs = sorted(hist)
            ax.plot(xs, [hist[x] / total for x in xs], marker="o", ms=3, label=label)
    axes[0].set(title="Pr(accepted length >= t)", xlabel="depth t", ylabel="share of rounds")
    axes[1].set(title="accepted length per round", xlabel="accepted draft tokens",
                ylabel="share of rounds")
    axes[2].set(title="tree depth per round", xlabel="deepest node", ylabel="share of rounds")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    _save(fig, path, caption)


def draw_sweeps(sweeps: dict[str, dict], path: Path, caption: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
    fig.subplots_adjust(bottom=0.24, wspace=0.3, left=0.05, right=0.98, top=0.9)
    for ax, (param, series) in zip(axes, sweeps.items()):
        for label, points in series.items():
            xs = [float(x) for x in points]
            ax.plot(xs, [points[x] for x in points], marker="o", label=label)
        ax.set(xlabel=SWEEP_LABELS[param], ylabel="tau", title=f"tau vs {SWEEP_LABELS[param]}")
        if param in ("topk", "budget"):
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path, caption)


def draw_construction(ms: dict[str, dict], path: Path, caption: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.4))
    fig.subplots_adjust(bottom=0.22, top=0.9)
    methods = list(ms)
    batches = sorted({int(b) for per in ms.values() for b in per})
    width = 0.8 / max(1, len(batches))
    for j, b in enumerate(batches):
        values = [ms[m][str(b)] if str(b) in ms[m] else ms[m][b] for m in methods]
        bars = ax.bar([i + j * width for i in range(len(methods))], values, width,
                      label=f"batch {b}")
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([i + width * (len(batches) - 1) / 2 for i in range(len(methods))], methods)
    ax.set(ylabel="ms per round (median)", title="tree construction per round")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path, caption)


def draw_throughput(results: dict[str, dict], path: Path, caption: str) -> None:
    """results: 'method@concurrency' -> vLLM bench serve's result."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.6))
    fig.subplots_adjust(bottom=0.22, top=0.9)
    series: dict[str, dict[int, float]] = {}
    for key, r in results.items():
        method, c = key.rsplit("@", 1)
        series.setdefault(method, {})[int(c)] = r["output_throughput"]
    for method, points in series.items():
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="requests in flight (max concurrency)", ylabel="output tokens/s",
           title="throughput in vLLM (vllm bench serve)")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path, caption)


# -- the parts -----------------------------------------------------------------------------
def _models(args):
    """(target folder, drafter folder, prompts as text or ids, description)."""
    if args.quick:
        from vllm_dartree.testing import write_tiny_drafter, write_tiny_target
        root = args.workdir / "models"
        target = write_tiny_target(root / "target", head_dim=32, seed=1)
        drafter = write_tiny_drafter(root / "domino", "domino", target)
        import torch
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(5, 1000, (12,), generator=gen).tolist()]
        return str(target), str(drafter), prompts, "tiny random target and drafter (--quick)"
    from vllm_dartree.zoo.shipped import smollm2_pair
    target, drafter = smollm2_pair(args.target, args.drafter)
    from vllm_dartree.bench.datasets import load_prompts
    prompts = [q.prompt for name in args.datasets.split(",")
               for q in load_prompts(name, args.per_dataset)]
    return target, drafter, prompts, (f"{Path(target).name} + {Path(drafter).name}, "
                                      f"{len(prompts)} prompts ({args.datasets}, "
                                      f"{args.per_dataset} each, chat format)")


def _reference_parts(args, store: Store, data: dict, target_dir, drafter_dir, prompts, what):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dartree.prompts import chat_prompt_ids
    from vllm_dartree.reference.decoder import eos_token_ids, load_drafter_for, method_config
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    drafter = load_drafter_for(target, drafter_dir, torch.float32)
    eos = eos_token_ids(target, tokenizer)
    ids = [p if isinstance(p, list) else chat_prompt_ids(tokenizer, p) for p in prompts]
    common = dict(budget=8, width=4, topk=16) if args.quick else {}

    def run(name, method, **over):
        """A run by its configuration: a sweep point at the defaults is the method's run."""
        config = method_config(method, **{**common, **over})
        key = f"{method} {config.model_dump_json()}"
        return store.get(key, lambda: asdict(measure(target, drafter, ids, method,
                                                     {**common, **over},
                                                     args.max_new_tokens, eos, name)))
    where = (f"{what}; reference decoder (batch 1), greedy, {args.max_new_tokens} new tokens, "
             f"float32, this machine.")
    if "acceptance" in args.parts:
        runs = {m: run(m, m) for m, _ in CURVE_METHODS}
        data["acceptance"] = runs
        tree = "B 8, W 4, K 16" if args.quick else "B 64, W 12, K 64, beta -0.2"
        draw_acceptance(runs, args.out / "acceptance.png",
                        f"Per-depth acceptance and depth distributions ({tree}; chains: "
                        f"one node per depth). {where} Command: python -m "
                        f"vllm_dartree.bench.figures{' --quick' if args.quick else ''}")
    if "sweeps" in args.parts:
        sweeps = {}
        grid = QUICK_SWEEPS if args.quick else SWEEPS
        for param, (values, _default) in grid.items():
            series = {"DARTree pruned": {v: run(f"pruned {param}={v}", "dartree-pruned",
                                                **{param: v})["tau"] for v in values}}
            if param == "budget":
                series["DDTree"] = {v: run(f"ddtree budget={v}", "ddtree", budget=v)["tau"]
                                    for v in values}
            sweeps[param] = series
        data["sweeps"] = {p: {label: {str(k): v for k, v in pts.items()}
                              for label, pts in s.items()} for p, s in sweeps.items()}
        base = "B 8, W 4, K 16, beta -0.2" if args.quick else "B 64, W 12, K 64, beta -0.2"
        draw_sweeps(sweeps, args.out / "sweeps.png",
                    f"tau against one tree parameter at a time, the others at their defaults "
                    f"({base}). {where} Command: python -m vllm_dartree.bench.figures"
                    f"{' --quick' if args.quick else ''} --parts sweeps")


def _construction_part(args, store: Store, data: dict) -> None:
    from vllm_dartree.bench import construction
    shape = (["--hidden", "64", "--gru", "32", "--emb", "16", "--vocab", "512", "--repeats",
              "1"] if args.quick else [])

    def compute():
        result = construction.run(construction.parser().parse_args(["--batches", "1", "8",
                                                                    *shape]))
        return {m: {str(b): v for b, v in per.items()} for m, per in result.items()}
    ms = store.get("construction", compute)
    data["construction"] = ms
    shapes = "tiny shapes (--quick)" if args.quick else \
        "Qwen3-4B shapes (H 2560, GRU 1024, E 256, V 151936, 16 depths; K 64, W 12, B 64)"
    ratio = ms["sequential-heap"]["1"] / ms["dartree-pruned"]["1"]
    draw_construction(ms, args.out / "construction.png",
                      f"Tree construction per round, {shapes}, float32, this CPU (2 cores), "
                      f"medians; sequential heap / batched DARTree at batch 1: {ratio:.1f}x. "
                      f"Command: python -m vllm_dartree.bench.construction --batches 1 8")


def _throughput_part(args, data: dict, target: str, drafter: str, what: str) -> None:
    from vllm_dartree.bench import serve
    workdir = args.workdir / "serve"
    levels, methods = args.serve_concurrency, args.serve_methods
    out = workdir / "results.json"
    code = serve.main(["--target", target, "--drafter", drafter, "--methods", methods,
                       "--concurrency", levels, "--datasets", args.datasets,
                       "--per-dataset", str(args.serve_per_dataset), "--max-tokens",
                       str(args.max_new_tokens), "--workdir", str(workdir), "--out", str(out)])
    if code:
        raise RuntimeError("bench.serve failed")
    results = json.loads(out.read_text())
    data["throughput"] = {k: {f: r.get(f) for f in ("output_throughput", "request_throughput",
                                                      "median_tpot_ms", "median_ttft_ms",
                                                      "spec_decode_acceptance_length")}
                          for k, r in results.items()}
    draw_throughput(data["throughput"], args.out / "throughput.png",
                    f"Output tokens/s in vLLM against requests in flight: "
                    f"{Path(target).name} + {Path(drafter).name}, "
                    f"{len(args.datasets.split(',')) * args.serve_per_dataset} prompts "
                    f"({args.datasets}), "
                    f"{args.max_new_tokens} tokens, greedy, every request sent at once; "
                    f"methods: {methods} (dartree-fixed: 64 nodes every round). Command: "
                    f"python -m vllm_dartree.bench.serve --smollm2 --methods {methods} "
                    f"--concurrency {levels} --per-dataset {args.serve_per_dataset} "
                    f"--max-tokens {args.max_new_tokens}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.bench.figures",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--quick", action="store_true",
                        help="tiny random models, a few prompts, no vLLM servers")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    parser.add_argument("--per-dataset", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--serve-methods", default="plain,ngram,dartree,dartree-fixed",
                        help="throughput: bench.serve methods")
    parser.add_argument("--serve-concurrency", default="1,2,4,8,16",
                        help="throughput: requests in flight")
    parser.add_argument("--serve-per-dataset", type=int, default=6,
                        help="throughput: prompts per dataset")
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    if args.quick:
        args.max_new_tokens = min(args.max_new_tokens, 4)
        args.parts = [p for p in args.parts if p != "throughput"]
    if args.workdir is None:
        args.workdir = (Path(tempfile.mkdtemp(prefix="dartree-figures-")) if args.quick
                        else Path("bench_results/figures"))
    args.out.mkdir(parents=True, exist_ok=True)
    target, drafter, prompts, what = _models(args)
    store = Store(args.workdir, {"target": target, "drafter": drafter, "quick": args.quick,
                                 "prompts": len(prompts), "max_new_tokens": args.max_new_tokens})
    data_file = args.out / "figures.json"
    data = json.loads(data_file.read_text()) if data_file.exists() and not args.quick else {}
    data["settings"] = {"what": what, "max_new_tokens": args.max_new_tokens,
                        "command": "python -m vllm_dartree.bench.figures"
                                   + (" --quick" if args.quick else "")}
    if {"acceptance", "sweeps"} & set(args.parts):
        _reference_parts(args, store, data, target, drafter, prompts, what)
    if "construction" in args.parts:
        _construction_part(args, store, data)
    if "throughput" in args.parts:
        _throughput_part(args, data, target, drafter, what)
    data_file.write_text(json.dumps(data, indent=2) + "\n")
    for name in args.parts:
        print(f"{name}: {args.out / (name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
