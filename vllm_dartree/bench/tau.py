"""The Table-1-style table: acceptance length tau and speedup over AR, per method and dataset.

    python -m vllm_dartree.bench.tau [--limit 2] [--max-new-tokens 48] [--temperatures 0,1]
        [--datasets gsm8k,math500,aime25,humaneval,mt-bench] [--out bench_results/tau]
        [--target DIR --drafter DIR]

Without --target / --drafter it prepares SmolLM2-135M-Instruct (`zoo.smollm2`) and uses the
drafter shipped for it (`zoo.shipped`). Every method runs in the reference decoder (one
request at a time, the paper's batch size 1) on the same prompts in one process; speedup is
the method's tokens/s over AR's on the same dataset and temperature, measured in this run.
At T = 0 every method's output is compared with AR's token for token (the `lossless` line).
Finished cells are kept in OUT/cells.jsonl, so a cut-off run resumes where it stopped (only
with the same target, drafter weights and sizes: anything else starts over); the table goes
to stdout and to OUT/table.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ROWS", "Cell", "run_cell", "format_table", "weights_fingerprint", "main"]

# (method of the reference decoder, row label)
ROWS = (
    ("ar", "AR"),
    ("dflash", "DFlash chain"),
    ("ddtree", "DDTree (B=64)"),
    ("domino", "Domino chain"),
    ("dartree-fixed", "DARTree fixed (B=64, 4/depth)"),
    ("dartree-pruned", "DARTree pruned (B=64, W=12, beta=-0.2)"),
)
DEFAULT_DATASETS = ("gsm8k", "math500", "aime25", "humaneval", "mt-bench")


@dataclass
class Cell:
    temperature: float
    dataset: str
    method: str
    tau: float
    tokens_per_second: float
    output_tokens: int
    outputs: list[list[int]]


def run_cell(target, drafter, prompts: list[list[int]], method: str, temperature: float,
             max_new_tokens: int, eos: tuple[int, ...], dataset: str = "",
             seed: int = 0) -> Cell:
    """One method on one prompt set: tau (macro average over requests) and tokens/s."""
    from tqdm import tqdm

    from vllm_dartree.reference import DrafterSession, ReferenceDecoder, SamplingParams
    from vllm_dartree.reference.decoder import method_config
    from vllm_dartree.reference.stats import summarize

    config = method_config(method)
    results = []
    for i, prompt in enumerate(tqdm(prompts, desc=f"T={temperature:g} {dataset} {method}",
                                    file=sys.stderr, leave=False)):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                seed=seed + i, eos_token_ids=eos)
        session = DrafterSession(drafter) if config is not None else None
        results.append(ReferenceDecoder(target, session, config).generate(prompt, params))
    summary = summarize(method, results)
    return Cell(temperature, dataset, method, summary.tau, summary.tokens_per_second,
                summary.output_tokens, [r.output_tokens for r in results])


def weights_fingerprint(folder: Path) -> str:
    """sha256 over a drafter folder's config and weight files: a drafter retrained in place
    (same path, new weights) must not reuse the cells of the one before."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*")):
        if path.is_file() and path.suffix in (".json", ".safetensors", ".pt", ".bin"):
            digest.update(path.name.encode())
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def _key(temperature: float, dataset: str, method: str) -> str:
    return f"{temperature:g}|{dataset}|{method}"


def format_table(cells: dict[str, Cell], temperature: float, datasets: list[str],
                 methods: list[str]) -> str:
    """Markdown: one row per method, `tau (speedup)` per dataset and their averages."""
    labels = dict(ROWS)
    head = ["Method", *datasets, "Avg"]
    lines = [f"T = {temperature:g}", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for method in methods:
        row, taus, speeds = [labels.get(method, method)], [], []
        for ds in datasets:
            cell = cells.get(_key(temperature, ds, method))
            base = cells.get(_key(temperature, ds, "ar"))
            if cell is None:
                row.append("-")
                continue
            taus.append(cell.tau)
            if base is not None and base.tokens_per_second:
                speed = cell.tokens_per_second / base.tokens_per_second
                speeds.append(speed)
                row.append(f"{cell.tau:.2f} ({speed:.2f}x)")
            else:
                row.append(f"{cell.tau:.2f}")
        avg = f"{sum(taus) / len(taus):.2f}" if taus else "-"
        if speeds:
            avg += f" ({sum(speeds) / len(speeds):.2f}x)"
        lines.append("| " + " | ".join([row[0], *row[1:], avg]) + " |")
    return "\n".join(lines)


def lossless_report(cells: dict[str, Cell], datasets: list[str], methods: list[str]) -> str:
    """At T = 0 every method must reproduce AR's tokens: count the requests that differ."""
    checked = differ = 0
    for ds in datasets:
        base = cells.get(_key(0.0, ds, "ar"))
        for m in methods:
            cell = cells.get(_key(0.0, ds, m))
            if base is None or cell is None or m == "ar":
                continue
            for a, b in zip(base.outputs, cell.outputs):
                checked += 1
                differ += a != b
    if not checked:
        return ""
    return (f"lossless (T = 0): {checked - differ}/{checked} requests identical to AR"
            + ("" if not differ else "  <-- MISMATCH"))


def _load_cells(path: Path) -> dict[str, Cell]:
    cells = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                c = Cell(**json.loads(line))
                cells[_key(c.temperature, c.dataset, c.method)] = c
    return cells


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_dartree.bench.tau",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, help="target folder (default: SmolLM2, prepared)")
    p.add_argument("--drafter", type=Path, help="drafter folder (default: the shipped one)")
    p.add_argument("--models-dir", type=Path, help="where SmolLM2 is prepared")
    p.add_argument("--datasets", default=",".join(DEFAULT_DATASETS))
    p.add_argument("--methods", default=",".join(m for m, _ in ROWS))
    p.add_argument("--limit", type=int, default=2, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, default=Path("bench_results/tau"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dartree.bench.datasets import chat_prompt_ids, load_prompts
    from vllm_dartree.reference.decoder import eos_token_ids, load_drafter_for

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "ar" not in methods:
        methods.insert(0, "ar")                 # speedups and the lossless check need it
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    temps = [float(t) for t in args.temperatures.split(",")]
    if args.target is None:
        from vllm_dartree.zoo.smollm2 import prepare_smollm2
        args.target = prepare_smollm2(args.models_dir)
    if args.drafter is None:
        from vllm_dartree.zoo.shipped import shipped_drafter
        args.drafter = shipped_drafter(args.target)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafter = load_drafter_for(target, args.drafter, dtype)
    eos = eos_token_ids(target, tokenizer)
    prompts = {ds: [chat_prompt_ids(tokenizer, p.prompt)
                    for p in load_prompts(ds, args.limit)] for ds in datasets}
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "cells.jsonl"
    settings = {"target": str(args.target), "drafter": str(args.drafter),
                "drafter_weights": weights_fingerprint(args.drafter), "limit": args.limit,
                "max_new_tokens": args.max_new_tokens, "dtype": args.dtype}
    settings_file = args.out / "settings.json"
    if settings_file.exists() and json.loads(settings_file.read_text()) != settings:
        store.unlink(missing_ok=True)           # another configuration: start over
    settings_file.write_text(json.dumps(settings, indent=2))
    cells = _load_cells(store)
    for t in temps:
        for ds in datasets:
            for m in methods:
                if _key(t, ds, m) in cells:
                    continue
                cell = run_cell(target, drafter, prompts[ds], m, t, args.max_new_tokens, eos,
                                dataset=ds)
                cells[_key(t, ds, m)] = cell
                with open(store, "a") as f:
                    f.write(json.dumps(cell.__dict__) + "\n")
                print(f"T={t:g} {ds:10s} {m:15s} tau {cell.tau:.2f}  "
                      f"{cell.tokens_per_second:.1f} tok/s", file=sys.stderr, flush=True)
    header = (f"{Path(args.target).name}, drafter {Path(args.drafter).name}; {args.limit} "
              f"prompts per dataset, {args.max_new_tokens} new tokens, {args.dtype}, "
              f"reference decoder (batch 1, CPU). Cells: tau (speedup over AR).")
    parts = [header] + [format_table(cells, t, datasets, methods) for t in temps]
    report = lossless_report(cells, datasets, methods)
    if report:
        parts.append(report)
    text = "\n\n".join(parts)
    (args.out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
