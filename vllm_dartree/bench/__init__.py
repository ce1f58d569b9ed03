"""Benchmarks: each prints ratios measured in one run (never a timed test).

- `python -m vllm_dartree.bench.construction`: per-round tree construction time.
"""

__all__: list[str] = []
