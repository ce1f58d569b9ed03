"""A reference speculative decoder on Hugging Face transformers (no vllm import).

The correctness oracle for the engines and the CPU benchmark engine: every method of the
paper (AR, DFlash chain, DDTree, Domino chain, DARTree fixed / pruned, sequential heap,
Domino chain + DDTree) on one drafter, greedy or sampled, with per-round statistics.
`python -m vllm_dartree.reference --help` for the command line.
"""

from vllm_dartree.reference.decoder import (
    METHODS,
    DraftModel,
    DrafterSession,
    ReferenceDecoder,
    SamplingParams,
    compact_cache,
    method_config,
)
from vllm_dartree.reference.stats import RequestResult, RoundStats, Summary, format_summary
from vllm_dartree.reference.stats import summarize

__all__ = [
    "METHODS", "DraftModel", "DrafterSession", "ReferenceDecoder", "RequestResult",
    "RoundStats", "SamplingParams", "Summary", "compact_cache", "format_summary",
    "method_config", "summarize",
]
