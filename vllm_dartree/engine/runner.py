"""`DARTreeRunnerMixin`: tree speculation inside vLLM's V1 model runner (CPU and GPU share it).

vLLM's runner speculates with chains. One dartree step, in the runner's own order (stages
1-3 here; the tree inputs in `tree_inputs`, 4 in `tree_sampler`, 5 in `compaction`, 6 and the
adaptive budget's decisions in `drafting`, the budget itself in `controller`):

1. `_update_states`: requests that finished (or were aborted) free their drafter context.
2. `_prepare_inputs`: the scheduler gave each request a *prefix* of the draft tokens we
   proposed (`scheduled_spec_decode_tokens`). When it matches the stored tree, the rows
   `[root] + nodes` get positions `p0 + depth` (slots stay chain slots) and an ancestor
   bitmask (a tree that is one path keeps a chain's positions and causal mask: vLLM's own
   attention serves it); otherwise (the scheduler's `-1` padding, a stale draft) the drafts
   are treated as a chain, which the walk rejects token by token, as plain decoding would.
3. `_build_attention_metadata`: the masks are attached to this step's attention metadata.
4. `_sample`: the greedy or sampled tree walk (`vllm_dartree.tree.verify`) with each
   request's temperature, top-k, top-p and seed, in the rejection sampler's output format
   (`[R, 1 + N]`, accepted tokens + bonus, -1 padded). A request that asks for anything else
   (`tree_sampler.full_sampler_fields`, an allow-list: logprobs, penalties, bad words,
   structured output, `extra_args`, any field vLLM adds later) is never proposed a tree and
   is sampled by vLLM's sampler from its root row, alone: the rest of the batch keeps its
   trees. Requests without a tree this step (prefills, plain steps) take vLLM's own sample,
   so a seeded request's first token is plain decoding's.
5. `_update_states_after_model_execute`: KV compaction, the accepted nodes' K/V move into
   chain slots p0+1..p0+L before the scheduler (which assumes a chain) sees the result.
6. `propose_draft_token_ids`: the target's aux hidden states of every committed row (prompt
   chunks, root, accepted nodes) extend each request's drafter context; the adaptive budget
   picks who drafts and how deep (nobody: a plain step, no drafter pass); one batched draft
   builds the trees, each cut to what it earns; their tokens go to the scheduler, their
   shape stays here. Every decode step is timed for the budget's cost model.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

from vllm_dartree.engine.compaction import CompactionMixin
from vllm_dartree.engine.controller import TreeBudget
from vllm_dartree.engine.drafting import DraftingMixin
from vllm_dartree.engine.live_state import StatePublisher, state_path
from vllm_dartree.engine.lookup_branches import LookupBranches
from vllm_dartree.engine.settings import EngineSettings
from vllm_dartree.engine.tree_inputs import StepTrees, StoredTree, is_chain, tree_rows
from vllm_dartree.engine.tree_sampler import TreeSamplerMixin, needs_full_sampler

__all__ = ["DARTreeRunnerMixin", "DARTreeWorkerMixin", "needs_full_sampler", "tree_rows"]

logger = logging.getLogger("vllm.dartree")


class DARTreeRunnerMixin(TreeSamplerMixin, CompactionMixin, DraftingMixin):
    """Put first in the MRO of a V1 model runner: `class R(DARTreeRunnerMixin, CPUModelRunner)`."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.dartree = EngineSettings.from_vllm_config(vllm_config)
        self._dt_trees: dict[str, StoredTree] = {}
        self._dt_step: StepTrees | None = None
        self._dt_broken: set[str] = set()
        self._dt_context = None                       # LazyContext, made with the drafter
        self.use_aux_hidden_state_outputs = True
        self.dartree_seconds: dict[str, float] = defaultdict(float)
        self._dt_budget: TreeBudget | None = None     # created with the drafter (adaptive)
        self._dt_lookup = LookupBranches(self.dartree.config) if self.dartree.config.lookup \
            else None
        self._dt_clock: list[float] = []              # this step's (start, drafting seconds)
        # this step's (rows, trees, the budget's last plan: whose trees it verifies) to time
        self._dt_timing: tuple[int, bool, int, int] | None = None
        self._dt_custom_logitsprocs = self._dt_install_logitsprocs(vllm_config, device)
        self._dt_faults: dict[str, int] = {"draft_errors": 0, "invalid_trees": 0}
        self._dt_fault_logged: set[str] = set()
        self._dt_publisher = StatePublisher(state_path(vllm_config))

    def _dt_publish_state(self) -> None:
        """The per-request state this worker holds, for /metrics (`engine.live_state`); under
        tensor parallelism rank 0's, which holds the drafter state (the others hold none)."""
        group = self._dt_tp_group()
        if group is not None and group.rank_in_group != 0:
            return
        drafter = getattr(self.drafter, "tree_drafter", None)
        self._dt_publisher.publish({
            "drafter_contexts": int(getattr(drafter, "live_requests", 0) or 0),
            "stored_trees": len(self._dt_trees),
            "pending_contexts": 0 if self._dt_context is None else len(self._dt_context),
            "budget_requests": 0 if self._dt_budget is None else self._dt_budget.live_requests,
            "lookup_requests": 0 if self._dt_lookup is None else len(self._dt_lookup),
            "no_context_requests": len(self._dt_broken), **self._dt_faults})

    def _dt_install_logitsprocs(self, vllm_config, device) -> tuple[str, ...]:
        """Logits processors installed as plugins (entry point group
        `vllm.logits_processors`): with speculation on, vLLM builds none of them and drops
        them silently; dartree builds them, and since one may act on any request, every
        request is then sampled by vLLM's sampler (no trees: exact, not faster)."""
        try:
            from vllm.v1.sample.logits_processor import (LogitsProcessors,
                                                         _load_logitsprocs_plugins)
        except ImportError:   # a vLLM without plugin logits processors
            return ()
        custom = _load_logitsprocs_plugins()
        batch = getattr(self, "input_batch", None)
        if not custom or batch is None:
            return ()
        pin = bool(getattr(self, "pin_memory", False))
        batch.logitsprocs = LogitsProcessors(
            [*batch.logitsprocs.all, *(cls(vllm_config, device, pin) for cls in custom)])
        batch.logitsprocs_need_output_token_ids = True
        names = tuple(f"{cls.__module__}.{cls.__qualname__}" for cls in custom)
        logger.warning("dartree: logits processor plugins %s are installed; they may act on "
                       "any request, so every request is sampled by vLLM's sampler without "
                       "speculation (exact, not faster)", list(names))
        return names

    @contextmanager
    def _dt_timed(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.dartree_seconds[stage] += time.perf_counter() - start

    def execute_model(self, *args, **kwargs):
        self._dt_clock = [time.perf_counter(), 0.0]
        with self._dt_timed("target"):
            return super().execute_model(*args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        with self._dt_timed("sample"):
            result = super().sample_tokens(*args, **kwargs)
        self._dt_time_step()
        return result

    def _dt_time_step(self) -> None:
        """The cost model's data: a decode step's seconds without drafting, by rows."""
        timing, self._dt_timing = self._dt_timing, None
        if self._dt_budget is None or timing is None or len(self._dt_clock) != 2:
            return
        start, drafting = self._dt_clock
        rows, tree, plan, nodes = timing
        self._dt_budget.observe_step(rows, tree, time.perf_counter() - start - drafting,
                                     plan=plan, nodes=nodes)

    # -- setup ---------------------------------------------------------------------------
    @property
    def _dt_drafter(self):
        drafter = getattr(self.drafter, "tree_drafter", None)
        if drafter is None:
            raise RuntimeError("the dartree drafter is not loaded (load_model has not run)")
        return drafter

    def _get_eagle3_aux_layers_from_config(self):
        ids = tuple(self._dt_drafter.layer_ids)
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"drafter target_layer_ids {list(ids)} must be increasing")
        return tuple(i + 1 for i in ids)   # aux index k = output of decoder layer k - 1

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise NotImplementedError("dartree supports models with one KV-cache group "
                                      "(full attention in every layer)")
        return super().initialize_kv_cache(kv_cache_config, *args, **kwargs)

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        # Trees are cut by the scheduler to what fits; never vLLM's zero-filled drafts.
        return common_attn_metadata is not None

    # -- 1. request lifecycle --------------------------------------------------------------
    def _update_states(self, scheduler_output):
        drafter = getattr(self.drafter, "tree_drafter", None)
        gone = set(scheduler_output.finished_req_ids)
        gone |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for rid in gone:
            self._dt_trees.pop(rid, None)
            self.__dict__.get("_dt_full_cache", {}).pop(rid, None)
            self._dt_broken.discard(rid)
            if self._dt_context is not None and rid in scheduler_output.finished_req_ids:
                self._dt_context.free(rid)
            if self._dt_lookup is not None:
                self._dt_lookup.free(rid)
            if drafter is not None and rid in scheduler_output.finished_req_ids:
                drafter.free(rid)
                if self._dt_budget is not None:
                    self._dt_budget.free(rid)
        result = super()._update_states(scheduler_output)
        if gone:
            self._dt_publish_state()
        return result

    # -- 2. positions and masks ----------------------------------------------------------
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        self._dt_step = None
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        num_reqs = self.input_batch.num_reqs
        req_ids = list(self.input_batch.req_ids[:num_reqs])
        rows = np.asarray(num_scheduled_tokens[:num_reqs], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        p0 = self.input_batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        spec = scheduler_output.scheduled_spec_decode_tokens
        drafts, trees = [], []
        for i, rid in enumerate(req_ids):
            scheduled = list(spec.get(rid, ()))
            stored = self._dt_trees.pop(rid, None)
            n = len(scheduled)
            match = (n > 0 and stored is not None and rows[i] == n + 1
                     and stored.tokens[:n] == scheduled)
            drafts.append(scheduled)
            trees.append(StoredTree(scheduled, stored.parents[:n], stored.depths[:n],
                                     None if stored.scores is None else stored.scores[:n],
                                     None if stored.sources is None else stored.sources[:n])
                         if match else None)
        step = StepTrees(req_ids, starts, rows, p0, drafts, trees)
        # a tree that is a chain (each node the child of the one before) is verified as
        # causal rows: its positions are the chain's slots and its mask the causal one, so
        # vLLM's own attention serves it and it needs no mask (the walk still reads it)
        step.is_tree = [t is not None and not is_chain(t.parents) for t in trees]
        step.decode_only = bool(num_reqs) and all(
            int(rows[i]) == 1 + len(drafts[i]) for i in range(num_reqs))
        plans = 0 if self._dt_budget is None else self._dt_budget.stats["steps"]
        self._dt_timing = (int(rows.sum()), any(t is not None for t in trees), plans,
                           int(rows.sum()) - num_reqs) if step.decode_only else None
        inputs = tree_rows([(t.parents, t.depths) if tree else None
                            for t, tree in zip(trees, step.is_tree)],
                           starts, rows, p0, self.positions.device)
        if inputs is not None:
            step.tree_mask, index, positions = inputs
            self.positions.index_copy_(0, index, positions)   # in place: p0 + depth
        self._dt_step = step
        return result

    # -- 3. attention metadata -----------------------------------------------------------
    def _build_attention_metadata(self, *args, **kwargs):
        result = super()._build_attention_metadata(*args, **kwargs)
        step = self._dt_step
        metadata = result[0]
        groups = metadata if isinstance(metadata, list) else [metadata]
        for group in groups:
            for md in (group or {}).values():
                if hasattr(md, "attach_trees"):
                    fresh = step is not None and len(md.seq_lens) >= len(step.req_ids)
                    if fresh and step.tree_mask is not None:
                        md.attach_trees(step.is_tree, step.tree_mask)
                    else:
                        md.attach_trees(None, None)
        return result


class DARTreeWorkerMixin:
    """What both dartree workers (CPU, GPU) add to vLLM's: per-stage timings of the runner."""

    def dartree_seconds(self, reset: bool = False) -> dict[str, float]:
        """Seconds spent per stage in this worker (`LLM.collective_rpc("dartree_seconds")`)."""
        seconds = dict(self.model_runner.dartree_seconds)
        if reset:
            self.model_runner.dartree_seconds.clear()
        return seconds

    def dartree_budget(self) -> dict:
        """The adaptive budget's counters and fitted costs (`collective_rpc("dartree_budget")`):
        plain / tree / exploring steps, verified trees and nodes, predicted vs observed
        accepted tokens, lookup nodes verified / accepted, live per-request state (lookup
        indices included), index rebuilds, and the drafter's faults (draft_errors,
        invalid_trees: requests that decoded without a tree because of them); only the
        faults with `adaptive: false`."""
        runner = self.model_runner
        if runner._dt_budget is None:
            return dict(runner._dt_faults)
        lookup = runner._dt_lookup
        return {**runner._dt_budget.summary(), **runner._dt_faults,
                "lookup_live_requests": 0 if lookup is None else len(lookup),
                "lookup_rebuilds": 0 if lookup is None else lookup.rebuilds}
