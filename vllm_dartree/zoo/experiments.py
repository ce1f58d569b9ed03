"""Drafter recipe experiments: short `zoo.train` runs that differ in one thing each, measured
on the same 16 held-out responses (teacher-forced chain acceptance, `--evaluate`'s number).

    python -m vllm_dartree.zoo.experiments --target DIR --data DIR --workdir DIR
        [--steps 300] [--only NAME,...]

Every run lives in WORKDIR/NAME and resumes from its checkpoint, and finished results are
kept in WORKDIR/results.json, so the command can be cut off and re-run; it prints the
markdown table at the end. The baseline is the shipped drafter's recipe with the draft
vocabulary (1 random draft layer, AdamW 6e-4 cosine, lambda 1.0 -> 0.1, 32 anchors).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["EXPERIMENTS", "main"]

LAYERS = "1,8,14,20,27"
# name -> (what changes, extra zoo.train arguments)
EXPERIMENTS: dict[str, tuple[str, list[str]]] = {
    "baseline": ("the recipe (N = 8192, 1 random layer)", []),
    "init-target": ("draft layer initialised from target layer 15", ["--init-from-target", "15"]),
    "two-layers": ("2 draft layers", ["--draft-layers", "2"]),
    "lr-1.2e-3": ("learning rate 1.2e-3", ["--lr", "1.2e-3"]),
    "lr-constant": ("constant learning rate (no cosine decay)", ["--schedule", "constant"]),
    "lambda-0.5": ("uncorrected-CE weight ends at 0.5 (less weight on the head)",
                   ["--lambda-end", "0.5"]),
    "lambda-0.0": ("uncorrected-CE weight ends at 0 (all weight on the corrected CE)",
                   ["--lambda-end", "0.0"]),
    "vocab-16384": ("draft vocabulary N = 16384", ["--draft-vocab", "16384"]),
    "anchors-64": ("64 anchors per sequence", ["--anchors", "64"]),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.zoo.experiments",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--layers", default=LAYERS)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--only", help="comma-separated experiment names")
    parser.add_argument("--held-out", type=int, default=16)
    args = parser.parse_args(argv)

    from vllm_dartree.zoo.train import main as train
    names = args.only.split(",") if args.only else list(EXPERIMENTS)
    unknown = sorted(set(names) - set(EXPERIMENTS))
    if unknown:
        parser.error(f"unknown experiments {unknown}; known: {sorted(EXPERIMENTS)}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    results_path = args.workdir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for i, name in enumerate(names):
        key = f"{name}@{args.steps}"
        if key in results:
            continue
        print(f"[{i + 1}/{len(names)}] {name}: {EXPERIMENTS[name][0]}", flush=True)
        accepted = train(["--target", str(args.target), "--data", str(args.data),
                          "--layers", args.layers, "--workdir", str(args.workdir / name),
                          "--steps", str(args.steps), "--log-every", "50",
                          "--held-out", str(args.held_out),
                          *EXPERIMENTS[name][1]])
        results[key] = accepted
        results_path.write_text(json.dumps(results, indent=2))
    base = results.get(f"baseline@{args.steps}")
    print(f"\n| experiment ({args.steps} steps) | held-out accepted | vs baseline |")
    print("|---|---:|---:|")
    for name in names:
        got = results.get(f"{name}@{args.steps}")
        if got is None:
            continue
        ratio = f"{got / base:.2f}x" if base else "-"
        print(f"| {EXPERIMENTS[name][0]} | {got:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
