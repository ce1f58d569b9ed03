"""`DARTreeRunnerMixin`: tree speculation inside vLLM's V1 model runner (CPU and GPU share it).

vLLM's runner speculates with chains. One dartree step, in the runner's own order:

1. `_update_states`: requests that finished (or were aborted) free their drafter context.
2. `_prepare_inputs`: the scheduler gave each request a *prefix* of the draft tokens we
   proposed (`scheduled_spec_decode_tokens`). When it matches the stored tree, the rows
   `[root] + nodes` get positions `p0 + depth` (slots stay chain slots) and an ancestor
   bitmask; otherwise (the scheduler's `-1` padding, a stale draft) the drafts are treated
   as a chain, which the walk rejects token by token, exactly as plain decoding would.
3. `_build_attention_metadata`: the masks are attached to this step's attention metadata.
4. `_sample`: the greedy or sampled tree walk (`vllm_dartree.tree.verify`) with each
   request's temperature, top-k, top-p and seed, in the rejection sampler's output format
   (`[R, 1 + N]`, accepted tokens + bonus, -1 padded). A batch holding a request that needs
   vLLM's full sampler (logprobs, penalties, bad words, min_tokens, min_p, logit bias,
   allowed tokens, structured output) samples every request from its root row with vLLM's
   sampler instead (all drafts rejected: exact, only slower); no drafts are proposed while
   such a request is in the batch. Requests without a tree this step (prefills, plain
   steps) take vLLM's own sample, so a seeded request's first token is plain decoding's.
5. `_update_states_after_model_execute`: KV compaction, the accepted nodes' K/V move into
   chain slots p0+1..p0+L before the scheduler (which assumes a chain) sees the result.
6. `propose_draft_token_ids`: the target's aux hidden states of every committed row (prompt
   chunks, root, accepted nodes) extend each request's drafter context; one batched draft
   builds the trees; their tokens go to the scheduler, their shape stays here.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_dartree import ops
from vllm_dartree.engine.controller import TreeBudget
from vllm_dartree.engine.settings import EngineSettings
from vllm_dartree.tree import TreeBatch
from vllm_dartree.tree.verify import sample_target_tokens, walk

__all__ = ["DARTreeRunnerMixin", "DARTreeWorkerMixin", "needs_full_sampler", "tree_rows"]

logger = logging.getLogger("vllm.dartree")


def needs_full_sampler(sp) -> bool:
    """Sampling features the tree walk does not implement (vLLM's sampler handles them)."""
    if sp is None:
        return False
    return bool(
        sp.logprobs is not None
        or sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0
        or sp.min_p or sp.bad_words or sp.logit_bias or sp.allowed_token_ids
        or (sp.min_tokens and (sp.all_stop_token_ids or sp.stop_token_ids))
        or sp.structured_outputs is not None)


def tree_rows(trees: list[tuple[torch.Tensor, torch.Tensor] | None], starts: np.ndarray,
              rows: np.ndarray, p0: np.ndarray, device: torch.device | str,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One step's tree inputs for the whole batch, built on `device` in one pass.

    trees[i]: request i's (parents [n], depths [n]) when its rows are `[root] + n nodes`
    (None: causal rows); starts / rows / p0: its first flattened row, its row count and its
    root's position. Returns (tree_mask [R, Qmax, ceil(Qmax / 32)] int32, the ancestor
    bitmask of every tree request's window and zeros elsewhere; index [M] and positions
    [M] int64, the flattened node rows and their positions p0 + depth, for an in-place
    `positions.index_copy_`), or None when no request has a tree. One host -> device copy
    and one mask launch (`ops.ancestor_bitmask`, Triton on CUDA); nothing is read back.
    """
    ids = [i for i, t in enumerate(trees) if t is not None]
    if not ids:
        return None
    counts = [int(trees[i][0].shape[0]) for i in ids]
    width = max(counts)
    parents = torch.full((len(ids), width), -1, dtype=torch.int64)
    index_parts, position_parts = [], []
    for j, (i, n) in enumerate(zip(ids, counts)):
        tree_parents, tree_depths = trees[i]
        parents[j, :n] = tree_parents.cpu()
        index_parts.append(int(starts[i]) + 1 + torch.arange(n))
        position_parts.append(int(p0[i]) + tree_depths.cpu().long())
    live = torch.arange(1 + width)[None, :] <= torch.tensor(counts)[:, None]   # [Rt, 1 + W]
    q_max = int(np.max(rows))
    words = (q_max + 31) // 32
    host = (parents, live, torch.tensor(ids), torch.cat(index_parts), torch.cat(position_parts))
    parents, live, ids_t, index, positions = (t.to(device, non_blocking=True) for t in host)
    bits = ops.ancestor_bitmask(parents)                               # [Rt, 1 + W, words_W]
    mask = torch.zeros(len(trees), q_max, words, dtype=torch.int32, device=device)
    mask[ids_t, :1 + width, :bits.shape[-1]] = bits * live[..., None]
    return mask, index, positions


@dataclass
class _StoredTree:
    tokens: list[int]
    parents: torch.Tensor   # [N] int64, -1 = root
    depths: torch.Tensor    # [N] int64
    scores: np.ndarray | None = None   # [N] float64, the drafter's path log-probabilities


@dataclass
class _Step:
    """What one engine step scheduled, per batch row."""
    req_ids: list[str]
    starts: np.ndarray          # first flattened row of each request
    rows: np.ndarray            # scheduled rows
    p0: np.ndarray              # position of the first scheduled row
    drafts: list[list[int]]     # scheduled draft tokens
    trees: list[_StoredTree | None]
    is_tree: list[bool] = field(default_factory=list)
    decode_only: bool = False   # every request decodes (no prompt chunk): a step to time
    tree_mask: torch.Tensor | None = None
    accepted: list[list[int]] | None = None   # accepted node indices, set by _sample


class DARTreeRunnerMixin:
    """Put first in the MRO of a V1 model runner: `class R(DARTreeRunnerMixin, CPUModelRunner)`."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.dartree = EngineSettings.from_vllm_config(vllm_config)
        self._dt_trees: dict[str, _StoredTree] = {}
        self._dt_step: _Step | None = None
        self._dt_broken: set[str] = set()
        self.use_aux_hidden_state_outputs = True
        self.dartree_seconds: dict[str, float] = defaultdict(float)
        self._dt_budget: TreeBudget | None = None     # created with the drafter (adaptive)
        self._dt_clock: list[float] = []              # this step's (start, drafting seconds)
        self._dt_timing: tuple[int, bool] | None = None   # this step's (rows, trees) to time

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
        self._dt_budget.observe_step(*timing, time.perf_counter() - start - drafting)

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
            self._dt_broken.discard(rid)
            if drafter is not None and rid in scheduler_output.finished_req_ids:
                drafter.free(rid)
                if self._dt_budget is not None:
                    self._dt_budget.free(rid)
        return super()._update_states(scheduler_output)

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
            trees.append(_StoredTree(scheduled, stored.parents[:n], stored.depths[:n],
                                     None if stored.scores is None else stored.scores[:n])
                         if match else None)
        step = _Step(req_ids, starts, rows, p0, drafts, trees)
        step.is_tree = [t is not None for t in trees]
        step.decode_only = bool(num_reqs) and all(
            int(rows[i]) == 1 + len(drafts[i]) for i in range(num_reqs))
        self._dt_timing = (int(rows.sum()), any(step.is_tree)) if step.decode_only else None
        inputs = tree_rows([(t.parents, t.depths) if t is not None else None for t in trees],
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

    # -- 4. the tree walk ----------------------------------------------------------------
    def _dt_full_sampler_batch(self, step: _Step) -> bool:
        return any(needs_full_sampler(getattr(self.requests.get(rid), "sampling_params", None))
                   for rid in step.req_ids)

    def _sample(self, logits, spec_decode_metadata):
        with self._dt_timed("walk"):
            return self._dt_sample(logits, spec_decode_metadata)

    def _dt_sample(self, logits, spec_decode_metadata):
        step = self._dt_step
        if spec_decode_metadata is None or step is None:
            return super()._sample(logits, spec_decode_metadata)
        from vllm.v1.outputs import SamplerOutput

        num = [len(d) for d in step.drafts]
        offsets = np.concatenate([[0], np.cumsum(np.asarray(num) + 1)[:-1]]).astype(np.int64)
        if not any(num) or self._dt_full_sampler_batch(step):
            # No drafts at all (prefills, plain steps): vLLM's own sampler, as without
            # speculation (the same seeded draws); or a request that needs its features.
            step.accepted = [[] for _ in num]
            roots = torch.as_tensor(offsets, device=logits.device)
            self.input_batch.update_async_output_token_ids()
            return self.sampler(logits=logits[roots],
                                sampling_metadata=self.input_batch.sampling_metadata)
        targets = self._dt_target_tokens(logits, step, offsets)
        tree = self._dt_tree_batch(step, logits.device)
        width = tree.max_nodes
        cols = torch.arange(1 + width, device=logits.device)
        index = torch.as_tensor(offsets, device=logits.device)[:, None] + torch.minimum(
            cols[None, :], torch.as_tensor(num, device=logits.device)[:, None])
        result = walk(tree, targets[index])
        sampled = result.output_tokens(tree).to(torch.int32)
        plain_rows = [i for i, n in enumerate(num) if n == 0]
        if plain_rows:   # requests without a tree this step: vLLM's sampler, as without
            roots = torch.as_tensor(offsets, device=logits.device)   # speculation
            metadata = self.input_batch.sampling_metadata
            # the tree requests' seeded streams must not depend on who shared their step
            saved = {i: g.get_state() for i, g in metadata.generators.items() if num[i]}
            stock = self.sampler(logits=logits[roots], sampling_metadata=metadata)
            for i, state in saved.items():
                metadata.generators[i].set_state(state)
            rows = torch.as_tensor(plain_rows, device=logits.device)
            sampled[rows, 0] = stock.sampled_token_ids[rows, 0].to(torch.int32)
        counts = result.num_accepted.tolist()
        nodes = result.accepted_nodes.tolist()
        step.accepted = [nodes[i][:c] for i, c in enumerate(counts)]
        self._dt_observe_walks(step)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)

    def _dt_greedy(self, rid) -> bool:
        sp = getattr(self.requests.get(rid), "sampling_params", None)
        return sp is None or sp.temperature < 1e-5

    def _dt_observe_walks(self, step: _Step) -> None:
        """The calibration's data: each verified tree's nodes, labelled by the walk."""
        if self._dt_budget is None:
            return
        for rid, tree, accepted in zip(step.req_ids, step.trees, step.accepted):
            if tree is not None and tree.scores is not None and len(tree.tokens):
                self._dt_budget.observe_walk(rid, self._dt_greedy(rid), tree.scores,
                                             tree.depths.numpy(), accepted)

    def _dt_tree_batch(self, step: _Step, device) -> TreeBatch:
        num_reqs = len(step.req_ids)
        width = max(1, max(len(d) for d in step.drafts))
        tokens = torch.zeros(num_reqs, width, dtype=torch.long)
        parents = torch.full((num_reqs, width), -1, dtype=torch.long)
        depths = torch.zeros(num_reqs, width, dtype=torch.long)
        for i, (draft, tree) in enumerate(zip(step.drafts, step.trees)):
            n = len(draft)
            if not n:
                continue
            tokens[i, :n] = torch.tensor(draft)
            if tree is not None:
                parents[i, :n], depths[i, :n] = tree.parents, tree.depths
            else:   # a chain: scheduler padding (-1) or a draft we do not know
                parents[i, :n] = torch.arange(-1, n - 1)
                depths[i, :n] = torch.arange(1, n + 1)
        num = torch.tensor([len(d) for d in step.drafts], dtype=torch.long)
        scores = torch.zeros(num_reqs, width)
        return TreeBatch(tokens.to(device), parents.to(device), depths.to(device),
                         scores.to(device), num.to(device))

    def _dt_target_tokens(self, logits: torch.Tensor, step: _Step, offsets) -> torch.Tensor:
        """The target's token at every logits row: argmax, or a sample with the request's
        temperature / top-k / top-p and its seeded generator."""
        tokens = logits.argmax(dim=-1)
        generators = self.input_batch.sampling_metadata.generators
        for i, rid in enumerate(step.req_ids):
            sp = getattr(self.requests.get(rid), "sampling_params", None)
            if sp is None or sp.temperature < 1e-5 or not step.drafts[i]:
                continue   # greedy, or no tree (vLLM's sampler draws that request's token)
            lo, hi = int(offsets[i]), int(offsets[i]) + len(step.drafts[i]) + 1
            top_k = sp.top_k if sp.top_k and sp.top_k > 0 else 0
            dev = logits.device
            tokens[lo:hi] = sample_target_tokens(
                logits[lo:hi][None], torch.tensor([float(sp.temperature)], device=dev),
                torch.tensor([top_k], device=dev), torch.tensor([float(sp.top_p)], device=dev),
                [generators.get(i)])[0]
        return tokens

    # -- 5. KV compaction ----------------------------------------------------------------
    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        super()._update_states_after_model_execute(output_token_ids, scheduler_output)
        step = self._dt_step
        if step is None or not step.accepted:
            return
        src, dst = [], []
        for i, nodes in enumerate(step.accepted):
            first = int(step.starts[i]) + 1
            for k, node in enumerate(nodes):
                if node != k:
                    src.append(first + node)
                    dst.append(first + k)
        if not src:
            return
        slot_mapping = self.input_batch.block_table.block_tables[0].slot_mapping.gpu
        src_slots = slot_mapping[torch.tensor(src)].long()
        dst_slots = slot_mapping[torch.tensor(dst)].long()
        with self._dt_timed("compaction"):
            self._dt_copy_slots(src_slots, dst_slots)

    def _dt_copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        from vllm_dartree.engine.attention import copy_slots
        seen = set()
        for kv in self.kv_caches:
            if kv is None or kv.data_ptr() in seen:
                continue
            seen.add(kv.data_ptr())
            copy_slots(kv, src_slots.to(kv.device), dst_slots.to(kv.device))

    # -- 6. drafting ---------------------------------------------------------------------
    def propose_draft_token_ids(self, *args, **kwargs):
        start = time.perf_counter()
        with self._dt_timed("draft"):
            out = self._dt_propose(*args, **kwargs)
        if len(self._dt_clock) == 2:
            self._dt_clock[1] += time.perf_counter() - start
        return out

    def _dt_propose(self, scheduler_output, sampled_token_ids, sampling_metadata,
                    hidden_states, sample_hidden_states, aux_hidden_states,
                    spec_decode_metadata, common_attn_metadata, slot_mappings):
        step, self._dt_step = self._dt_step, None
        num_reqs = self.input_batch.num_reqs
        out: list[list[int]] = [[] for _ in range(num_reqs)]
        if step is None or aux_hidden_states is None:
            return out
        drafter = self._dt_drafter
        features = torch.cat(list(aux_hidden_states), dim=-1)
        no_drafts = self._dt_full_sampler_batch(step)
        accepted = step.accepted or [[] for _ in step.req_ids]
        ext_ids, ext_tokens, ext_feats = [], [], []
        draft_rows, roots = [], []
        token_ids = self.input_batch.token_ids_cpu
        for i, rid in enumerate(step.req_ids):
            p0, start = int(step.p0[i]), int(step.starts[i])
            committed_rows = int(step.rows[i]) - len(step.drafts[i])
            rows = list(range(start, start + committed_rows))
            rows += [start + committed_rows + node for node in accepted[i]]
            have = drafter.length(rid)
            if have > p0:                       # re-prefill after preemption: rewind
                drafter.trim(rid, p0)
            elif have < p0 and rid not in self._dt_broken:
                # context the drafter never saw (e.g. a prefix-cache hit): plain decoding
                self._dt_broken.add(rid)
                logger.warning("dartree: request %s has no drafter context for its first %d "
                               "tokens; it decodes without speculation", rid, p0)
            if rid in self._dt_broken:
                continue
            ext_ids.append(rid)
            ext_tokens.append(token_ids[i, p0:p0 + len(rows)].tolist())
            ext_feats.append(features[torch.tensor(rows, device=features.device)])
            sampled = sampled_token_ids[i] if i < len(sampled_token_ids) else []
            if sampled and not no_drafts:
                draft_rows.append(i)
                roots.append(int(sampled[-1]))
        if ext_ids:
            drafter.extend(ext_ids, ext_tokens, ext_feats)
        if not draft_rows:
            return out
        rids = [step.req_ids[i] for i in draft_rows]
        greedy = [self._dt_greedy(rid) for rid in rids]
        budget = self._dt_budget_for(drafter)
        plan = None
        if budget is not None:   # adaptive: who drafts, and how deep (none: a plain step)
            plan = budget.plan(rids, greedy, num_reqs)
            keep = [j for j in range(len(rids)) if plan.nodes[j] > 0]
            if not keep:
                return out
            draft_rows, rids, roots, greedy = ([xs[j] for j in keep]
                                               for xs in (draft_rows, rids, roots, greedy))
            plan_index = keep
        start = time.perf_counter()
        trees = drafter.draft(rids, torch.tensor(roots, device=features.device),
                              num_depths=None if plan is None else plan.depth)
        counts = trees.num_nodes.tolist()
        tokens, parents, depths = (trees.tokens.cpu(), trees.parents.cpu(), trees.depths.cpu())
        scores = trees.scores.cpu().double().numpy()
        if budget is not None:
            budget.observe_draft(len(rids), plan.depth, time.perf_counter() - start)
        # vLLM's per-position counters and rejection buffers hold num_speculative_tokens
        # drafts: never hand the scheduler more (a prefix of a tree is a tree).
        limit = int(getattr(self.speculative_config, "num_speculative_tokens", None)
                    or self.dartree.config.budget)
        for j, (i, rid) in enumerate(zip(draft_rows, rids)):
            n = min(int(counts[j]), limit)
            if plan is not None and n:
                n = budget.cut(rid, greedy[j], scores[j, :n], depths[j, :n].numpy(), plan,
                               plan_index[j])
            if n == 0:
                continue
            draft = tokens[j, :n].tolist()
            self._dt_trees[rid] = _StoredTree(draft, parents[j, :n].clone(),
                                              depths[j, :n].clone(), scores[j, :n].copy())
            out[i] = draft
        return out

    def _dt_budget_for(self, drafter) -> TreeBudget | None:
        """The adaptive budget (None with `adaptive: false`), made once the drafter is known."""
        if not self.dartree.config.adaptive:
            return None
        if self._dt_budget is None:
            self._dt_budget = TreeBudget(self.dartree.config.budget, drafter.num_depths)
        return self._dt_budget


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
        accepted tokens, live per-request state; {} with `adaptive: false`."""
        budget = self.model_runner._dt_budget
        return {} if budget is None else budget.summary()
