"""DARTreeConfig: the one place where tree-speculation parameters are parsed and validated.

Defaults are the paper's (DARTree, "Experimental Setup"): B = 64, W = 12, K = 64,
beta = -0.2, 16 draft depths, pruned variant. Every error names the offending key.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["DARTreeConfig"]


class DARTreeConfig(BaseModel):
    """Tree construction parameters shared by every engine (reference decoder, vLLM)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    variant: Literal["pruned", "fixed"] = "pruned"
    """`pruned`: grow a supertree of `width` nodes per depth, then keep the global top-`budget`
    by `score + depth_bonus * depth`. `fixed`: `ceil(remaining / remaining_depths)` nodes per
    depth, `budget` in total, no pruning."""

    budget: int = Field(64, ge=1, le=1024)
    """B: number of draft nodes verified by the target in one pass (the root excluded)."""

    width: int = Field(12, ge=1)
    """W: nodes kept per depth while growing the pruned supertree."""

    topk: int = Field(64, ge=1)
    """K: candidate tokens per depth (the top-K of the backbone's base logits), shared by all
    parents at that depth. Must not exceed the vocabulary (see `check_drafter`)."""

    depth_bonus: float = Field(-0.2, allow_inf_nan=False)
    """beta: added once per depth to a node's score before the final top-B. Must be <= 0."""

    max_depth: int | None = Field(None, ge=1)
    """Deepest tree level; None = every depth the drafter predicts (16 for a b16 Domino)."""

    builder: Literal["dartree", "ddtree", "chain", "sequential-heap", "chain-ddtree"] = "dartree"
    """`dartree`: depth-wise batched construction (this paper). `ddtree`: best-first top-B over
    the uncorrected marginals. `chain`: one greedy path. `sequential-heap`: exact best-first
    search with the correction head run per pop, and `chain-ddtree`: DDTree over the
    distributions the head gives along the greedy chain (both ablations of the paper's
    Table 2)."""

    adaptive: bool = True
    """Engines only: size every request's tree each step to what it is expected to earn
    (calibrated acceptance of its nodes x the measured cost of verified rows and drafting),
    so `budget` is the most nodes a request verifies and 0 nodes, a plain step with no
    drafter pass, is chosen whenever speculation would not pay. False: every round verifies
    `budget` nodes (the paper's fixed-budget tables; the reference decoder always does)."""

    lookup: bool = True
    """Engines only: graft lookup branches onto every drafter tree: continuations of the
    request's current suffix found earlier in its prompt or output (n-gram matches, as vLLM's
    `ngram` proposer drafts them, several per round). They are verified in the same pass and
    ranked with the drafter's nodes by calibrated acceptance, one estimate per source."""

    drafter_dtype: Literal["model", "auto", "float32", "bfloat16", "float16"] = "model"
    """Engines only: the dtype the drafter runs in (its features, context K/V, layers and
    head; tree scores are always computed in float32, and the target is untouched, so the
    output does not depend on it). `model`: the target's dtype. `auto`: on a CPU with AMX
    the backbone in bfloat16 (its matrix units) and the correction head in the target's
    dtype (its per-depth steps of a few rows gained nothing in bf16; tokens/s level with
    `model` within noise, run AQ in docs/engine.md), elsewhere the target's dtype. An
    explicit dtype is the whole drafter's."""

    lookup_share: float = Field(0.5, gt=0, le=1)
    """The most nodes lookup may add to a tree, as a fraction of `budget` (rounded up)."""

    lookup_candidates: int = Field(4, ge=1, le=64)
    """Lookup continuations considered per round (longest match first, then most recent)."""

    lookup_min_n: int = Field(2, ge=1)
    """Shortest suffix (in tokens) that lookup matches."""

    lookup_max_n: int = Field(5, ge=1)
    """Longest suffix that lookup matches (longer matches rank first)."""

    lookup_max_match: int = Field(64, ge=1)
    """How far back a `lookup_max_n` match is measured (the common suffix of the request's
    tokens and what precedes that occurrence), up to this many tokens: a copy in progress
    that has matched tens of tokens is trusted further than a 5-token coincidence (its nodes'
    prior). `lookup_max_n` or less: the n-gram order alone."""

    correction: bool = True
    """Use the drafter's correction head (Domino GRU / DSpark Markov). False = the backbone's
    uncorrected marginals only (DFlash-like)."""

    @field_validator("depth_bonus")
    @classmethod
    def _non_positive_bonus(cls, value: float) -> float:
        if value > 0:
            raise ValueError(
                f"depth_bonus = {value} must be <= 0: with a positive bonus a child can outscore "
                "its parent, so the global top-B is no longer ancestor-closed and no longer equals "
                "best-first search (Lemma 1). Use a value in [-0.2, 0]."
            )
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> DARTreeConfig:
        if self.builder == "sequential-heap" and not self.correction:
            raise ValueError(
                "builder = 'sequential-heap' runs the correction head per pop and needs "
                "correction = true; use builder = 'ddtree' for the uncorrected heap."
            )
        if self.lookup_min_n > self.lookup_max_n:
            raise ValueError(
                f"lookup_min_n = {self.lookup_min_n} must be <= lookup_max_n = "
                f"{self.lookup_max_n}."
            )
        return self

    def lookup_nodes(self) -> int:
        """The most nodes lookup may add to one tree."""
        return -(-int(round(self.lookup_share * self.budget * 1000)) // 1000)

    def check_drafter(self, *, vocab_size: int, num_depths: int) -> None:
        """Validate the keys that depend on the drafter; raises ValueError naming the key."""
        if self.topk > vocab_size:
            raise ValueError(
                f"topk = {self.topk} must be <= the vocabulary size ({vocab_size})."
            )
        if self.max_depth is not None and self.max_depth > num_depths:
            raise ValueError(
                f"max_depth = {self.max_depth} must be <= the drafter's number of draft depths "
                f"({num_depths}); leave it unset to use them all."
            )

    def num_depths(self, drafter_depths: int) -> int:
        """Depths actually grown for a drafter that predicts `drafter_depths` positions."""
        return drafter_depths if self.max_depth is None else min(self.max_depth, drafter_depths)
