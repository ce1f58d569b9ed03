"""Repetitive prompt sets built from local text (no download): where lookup should shine.

- `code-edit`: "rewrite this function with one change" over functions of Python's standard
  library (the answer repeats most of the prompt);
- `summary`: "summarise / quote" tasks over module docstrings of the standard library (the
  answer reuses the passage's phrases).

Deterministic for a given Python version: the files are read in sorted order and the
selection is a fixed stride, so two runs on one machine see the same prompts.
"""

from __future__ import annotations

import ast
import sysconfig
import textwrap
from pathlib import Path

from vllm_dartree.bench.datasets import BenchPrompt

__all__ = ["REPETITIVE", "repetitive_prompts"]

REPETITIVE = ("code-edit", "summary")
_STDLIB_MODULES = ("argparse", "textwrap", "difflib", "shlex", "fractions", "heapq", "bisect",
                   "calendar", "statistics", "string", "tokenize", "glob", "fnmatch",
                   "ipaddress", "colorsys", "graphlib", "copy", "pprint", "csv", "gettext")


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _functions(min_lines: int = 10, max_lines: int = 30) -> list[tuple[str, str, str]]:
    """(qualified name, source, first parameter) of standard-library functions of 10-30
    lines with a parameter other than self / cls."""
    out = []
    for module in _STDLIB_MODULES:
        path = _stdlib() / f"{module}.py"
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                names = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
                if min_lines <= n <= max_lines and names:
                    source = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
                    out.append((f"{module}.{node.name}", source, names[0]))
    return sorted(out)


def _passages(min_chars: int = 400, max_chars: int = 1500) -> list[tuple[str, str]]:
    out = []
    for module in _STDLIB_MODULES:
        path = _stdlib() / f"{module}.py"
        if not path.exists():
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if doc and len(doc) >= min_chars:
            out.append((module, doc[:max_chars]))
    return sorted(out)


def _spread(items: list, limit: int | None) -> list:
    if not limit or limit >= len(items):
        return items
    stride = len(items) / limit
    return [items[int(i * stride)] for i in range(limit)]


def repetitive_prompts(name: str, limit: int | None = None) -> list[BenchPrompt]:
    if name == "code-edit":
        picked = _spread(_functions(), limit)
        return [BenchPrompt(name, qual, (
            f"Rewrite this Python function, renaming the parameter `{arg}` to `{arg}_value` "
            f"and changing nothing else. Reply with the whole function only.\n\n```python\n"
            f"{source}\n```",), (source,)) for qual, source, arg in picked]
    if name == "summary":
        picked = _spread(_passages(), limit)
        return [BenchPrompt(name, module, (
            "Summarise the following passage in a few sentences, reusing its own wording "
            f"where you can.\n\n{doc}",), (doc,)) for module, doc in picked]
    raise ValueError(f"unknown repetitive set {name!r}; available: {list(REPETITIVE)}")
