"""Code prompts for drafter training, built from local source files (no download).

    python -m vllm_dartree.zoo.code_prompts --out code_prompts.jsonl [--limit 1000]

Functions of 6-40 lines from Python's standard library, each turned into one of five
tasks a user asks a chat model about code (complete from the signature and docstring,
explain, add a docstring, add type hints, rewrite with a small change), the task rotating
with the function. The modules the evaluation's `code-edit` / `summary` sets are built from
(`bench.repetitive`) are left out, as are test suites and IDLE, so no evaluation function
is a training prompt. Deterministic for a given Python version (sorted files, sorted
functions, a fixed stride).
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
import textwrap
from pathlib import Path

__all__ = ["TASKS", "code_prompts", "solve_prompts", "main"]

TASKS = (
    "Complete this Python function. Reply with the whole function.\n\n```python\n{head}\n```",
    "Explain what this Python function does, step by step.\n\n```python\n{source}\n```",
    "Write a docstring for this Python function and reply with the function including "
    "it.\n\n```python\n{source}\n```",
    "Add type hints to this Python function. Reply with the whole function.\n\n```python\n"
    "{source}\n```",
    "Rewrite this Python function so that it is easier to read, keeping its behaviour. "
    "Reply with the code only.\n\n```python\n{source}\n```",
)


def _excluded() -> set[str]:
    from vllm_dartree.bench.repetitive import _STDLIB_MODULES
    return set(_STDLIB_MODULES)


def _files(root: Path) -> list[Path]:
    skip = _excluded()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = rel.parts
        if (len(parts) > 2 or "site-packages" in parts or any("test" in p for p in parts)
                or parts[0] in ("idlelib", "turtledemo", "lib2to3", "ensurepip", "venv")
                or rel.stem in skip or (len(parts) == 2 and parts[0] in skip)):
            continue
        out.append(path)
    return out


def _functions(path: Path, min_lines: int, max_lines: int) -> list[tuple[str, str]]:
    """(header + docstring, whole source) of the file's functions of the right size."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        n = node.end_lineno - node.lineno + 1
        if not min_lines <= n <= max_lines or node.name.startswith("__"):
            continue
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        source = textwrap.dedent("\n".join(lines[start - 1:node.end_lineno]))
        body = node.body[0]
        doc = ast.get_docstring(node) is not None
        head_end = (body.end_lineno if doc and len(node.body) > 1 else node.body[0].lineno - 1)
        head = textwrap.dedent("\n".join(lines[start - 1:head_end]))
        out.append((head if head.strip() else source, source))
    return out


def _items(min_lines: int, max_lines: int, root: Path | None) -> list[tuple[str, str]]:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    return sorted({f for path in _files(root) for f in _functions(path, min_lines, max_lines)},
                  key=lambda f: f[1])


def _spread(items: list, limit: int | None, offset: float = 0.0) -> list:
    """`limit` of the items spread evenly over all of them, from `offset` strides in."""
    if limit and limit < len(items):
        stride = len(items) / limit
        items = [items[int((i + offset) * stride)] for i in range(limit)]
    return items


def code_prompts(limit: int | None = None, min_lines: int = 6, max_lines: int = 40,
                 root: Path | None = None) -> list[str]:
    """Training prompts over standard-library functions, `limit` of them spread evenly."""
    return [TASKS[i % len(TASKS)].format(head=head, source=source)
            for i, (head, source) in enumerate(_spread(_items(min_lines, max_lines, root),
                                                       limit))]


def solve_prompts(limit: int | None = None, min_lines: int = 6, max_lines: int = 40,
                  root: Path | None = None) -> list[str]:
    """HumanEval-shaped requests (the evaluation's own wording, `bench.datasets`) over
    documented standard-library functions: "write a solution" to a signature and docstring.
    Half a stride away from `code_prompts`' picks, so the two lists share few functions."""
    from vllm_dartree.bench.datasets import CODE_TEMPLATE
    documented = [head for head, _ in _items(min_lines, max_lines, root)
                  if '"""' in head or "'''" in head]
    return [CODE_TEMPLATE.format(head) for head in _spread(documented, limit, 0.5)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.zoo.code_prompts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int)
    args = parser.parse_args(argv)
    prompts = code_prompts(args.limit)
    with open(args.out, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"{len(prompts)} code prompts -> {args.out}")


if __name__ == "__main__":
    main()
