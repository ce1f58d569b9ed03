"""`DraftingMixin`: the runner's drafting stage (stage 6 of a round) and the budget's cut.

The target's aux hidden states of every committed row (prompt chunks, root, accepted nodes)
extend each request's drafter context (lazily: only before the request drafts, or once 32
rows wait, `engine.lazy_context`); the adaptive budget (`engine.controller`) says who
drafts and how deep (nobody: a plain step, no drafter pass); one batched draft builds the
trees; each is cut to the prefix its nodes earn; their tokens go to the scheduler, their
shape stays in `_dt_trees` until the scheduler hands the prefix back. With `lookup` on,
continuations of each request's suffix found in its own tokens are grafted onto its tree
first (`engine.lookup_branches`), and the merged tree is ranked by acceptance estimates.
"""

from __future__ import annotations

import logging
import time

import torch

import numpy as np

from vllm_dartree.engine.controller import TreeBudget
from vllm_dartree.engine.lazy_context import LazyContext
from vllm_dartree.engine.tree_inputs import StoredTree

__all__ = ["DraftingMixin"]

logger = logging.getLogger("vllm.dartree")


class DraftingMixin:
    """Drafting for `DARTreeRunnerMixin` (uses its `_dt_step`, `_dt_trees`, `_dt_broken`)."""

    def propose_draft_token_ids(self, *args, **kwargs):
        start = time.perf_counter()
        with self._dt_timed("draft"):
            group = self._dt_tp_group()
            if group is None:
                out = self._dt_propose(*args, **kwargs)
            else:
                out = self._dt_share_trees(group, args, kwargs)
            self._dt_publish_state()
        if len(self._dt_clock) == 2:
            self._dt_clock[1] += time.perf_counter() - start
        return out

    def _dt_tp_group(self):
        """`_tp_group()`, looked up once (the groups are set up before the first step)."""
        if "_dt_group" not in self.__dict__:
            self._dt_group = _tp_group()
        return self._dt_group

    def _dt_share_trees(self, group, args, kwargs) -> list[list[int]]:
        """Tensor parallelism: rank 0 drafts (drafter context, adaptive budget, lookup and
        faults live there only) and broadcasts the round's draft tokens and tree shapes;
        every rank then builds the same masks from the same trees, and the tree walk, which
        runs on every rank on the same all-gathered logits, accepts the same nodes."""
        if group.rank_in_group == 0:
            step = self._dt_step
            out = self._dt_propose(*args, **kwargs)
            names = step.req_ids if step is not None else ()
            group.broadcast_object((out, {rid: self._dt_trees[rid] for rid in names
                                          if rid in self._dt_trees}), src=0)
            return out
        self._dt_step = None
        out, trees = group.broadcast_object(None, src=0)
        self._dt_trees.update(trees)
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
        context = self._dt_context_for(drafter)
        accepted = step.accepted or [[] for _ in step.req_ids]
        draft_rows, roots = [], []
        token_ids = self.input_batch.token_ids_cpu
        # every request's committed rows (prompt chunk or root, then its accepted nodes),
        # gathered from the aux hidden states at once: one index per layer, then views
        committed = [list(range(int(step.starts[i]),
                                int(step.starts[i]) + int(step.rows[i]) - len(step.drafts[i])))
                     + [int(step.starts[i]) + int(step.rows[i]) - len(step.drafts[i]) + node
                        for node in accepted[i]] for i in range(len(step.req_ids))]
        device = aux_hidden_states[0].device
        index = torch.tensor([r for rows in committed for r in rows], dtype=torch.long,
                             device=device)
        features = torch.cat([h.index_select(0, index) for h in aux_hidden_states], dim=-1)
        per_request = features.split([len(rows) for rows in committed])
        for i, rid in enumerate(step.req_ids):
            p0 = int(step.p0[i])
            rows = committed[i]
            have = context.length(rid)
            if have > p0:                       # re-prefill after preemption: rewind
                context.trim(rid, p0)
            elif have < p0 and rid not in self._dt_broken:
                # context the drafter never saw (e.g. a prefix-cache hit): plain decoding
                self._dt_broken.add(rid)
                logger.warning("dartree: request %s has no drafter context for its first %d "
                               "tokens; it decodes without speculation", rid, p0)
            if rid in self._dt_broken:
                continue
            if self._dt_lookup is not None:
                self._dt_lookup.sync(rid, token_ids[i], p0, len(rows))
            context.add(rid, token_ids[i, p0:p0 + len(rows)].tolist(), per_request[i])
            sampled = sampled_token_ids[i] if i < len(sampled_token_ids) else []
            if sampled and not self._dt_needs_full(rid):   # vLLM's sampler: no tree
                draft_rows.append(i)
                roots.append(int(sampled[-1]))
        context.flush()                         # only if too many bytes wait
        if not draft_rows:
            return out
        budget = self._dt_budget_for(drafter)
        if budget is not None and budget.skip(num_reqs):   # a run of plain plans: no plan
            return out
        rids = [step.req_ids[i] for i in draft_rows]
        greedy = [self._dt_greedy(rid) for rid in rids]
        lookup = self._dt_lookup
        found = [lookup.find(rid, root) if lookup is not None else []
                 for rid, root in zip(rids, roots)]
        plan = None
        if budget is not None:   # adaptive: who drafts, and how deep (none: a plain step)
            confidence = None if step.confidence is None else [
                float(step.confidence[i]) for i in draft_rows]
            plan = budget.plan(rids, greedy, num_reqs,
                               None if lookup is None else [lookup.profile(f) for f in found],
                               confidence)
            keep = [j for j in range(len(rids)) if plan.nodes[j] > 0]
            if not keep:
                return out
            draft_rows, rids, roots, greedy, found = ([xs[j] for j in keep] for xs in
                                                      (draft_rows, rids, roots, greedy, found))
            plan_index = keep
        # vLLM's per-position counters and rejection buffers hold num_speculative_tokens
        # drafts: never hand the scheduler more (a prefix of a tree is a tree).
        limit = int(getattr(self.speculative_config, "num_speculative_tokens", None)
                    or self.dartree.config.budget)
        if plan is not None and plan.depth == 0:   # lookup nodes only: no drafter pass
            counts = [0] * len(rids)
            tokens = parents = depths = torch.zeros(len(rids), 0, dtype=torch.int64)
            scores = np.zeros((len(rids), 0))
        else:
            # the drafter sees every committed row: the rows waiting are extended first, and
            # timed with the round (`observe_draft`: a round that extends a prompt is not)
            extended = sum(context.waiting(rid) for rid in rids)
            start = time.perf_counter()
            context.flush(rids)
            # a tree of n nodes is at most n deep: a fixed budget needs no deeper drafts
            trees = self._dt_safe_draft(drafter, rids, roots, device,
                                        limit if plan is None else plan.depth)
            counts, tokens, parents, depths, scores = trees
            if budget is not None:
                budget.observe_draft(len(rids), plan.depth, time.perf_counter() - start,
                                     extended)
        for j, (i, rid) in enumerate(zip(draft_rows, rids)):
            m = int(counts[j])
            tree = (tokens[j, :m].tolist(), parents[j, :m].numpy(), depths[j, :m].numpy(),
                    scores[j, :m], None)
            if lookup is not None:
                merged = lookup.graft(found[j], *tree[:4],
                                      self._dt_estimate(budget, rid, greedy[j]))
                if merged is not None:
                    tree = (merged.tokens, np.asarray(merged.parents), np.asarray(merged.depths),
                            np.asarray(merged.scores), np.asarray(merged.sources))
            draft, tree_parents, tree_depths, tree_scores, sources = tree
            n = min(len(draft), limit)
            if plan is not None and n:
                n = budget.cut(rid, greedy[j], tree_scores[:n], tree_depths[:n], plan,
                               plan_index[j], None if sources is None else sources[:n])
            if n == 0:
                continue
            self._dt_trees[rid] = StoredTree(
                draft[:n], torch.as_tensor(tree_parents[:n], dtype=torch.int64),
                torch.as_tensor(tree_depths[:n], dtype=torch.int64), tree_scores[:n].copy(),
                None if sources is None else sources[:n].copy())
            out[i] = draft[:n]
        return out

    def _dt_safe_draft(self, drafter, rids, roots, device, num_depths):
        """One batched draft, host-side: (counts, tokens, parents, depths, scores). A drafter
        that raises is retried one request at a time, so only the request it fails on goes
        without a tree; a tree that is not a tree (NaN or infinite scores, tokens outside
        the vocabulary, a parent that is not an earlier node, a depth that is not its
        parent's + 1) is dropped. Each fault is counted (`dartree_budget`: draft_errors,
        invalid_trees) and logged once per kind: the request decodes plainly that step."""
        try:
            parts = [drafter.draft(rids, torch.tensor(roots, device=device),
                                   num_depths=num_depths)]
            owners = [list(range(len(rids)))]
        except Exception as err:   # noqa: BLE001 - any drafter failure: isolate it
            self._dt_fault("draft_errors", f"the drafter raised {type(err).__name__}: {err}")
            parts, owners = [], []
            for j, rid in enumerate(rids):
                try:
                    parts.append(drafter.draft([rid], torch.tensor([roots[j]], device=device),
                                               num_depths=num_depths))
                    owners.append([j])
                except Exception:   # noqa: BLE001
                    self._dt_faults["draft_errors"] += 1
        width = max([int(t.max_nodes) for t in parts] + [0])
        r = len(rids)
        counts = torch.zeros(r, dtype=torch.int64)
        tokens = torch.zeros(r, width, dtype=torch.int64)
        parents = torch.full((r, width), -1, dtype=torch.int64)
        depths = torch.zeros(r, width, dtype=torch.int64)
        scores = torch.full((r, width), float("-inf"), dtype=torch.float64)
        for trees, rows in zip(parts, owners):   # one part unless the drafter raised
            at, n = torch.tensor(rows), trees.max_nodes
            counts[at] = trees.num_nodes.cpu()
            tokens[at, :n], parents[at, :n] = trees.tokens.cpu(), trees.parents.cpu()
            depths[at, :n], scores[at, :n] = trees.depths.cpu(), trees.scores.cpu().double()
        vocab = int(getattr(self.input_batch, "vocab_size", 0) or 0)
        for j, problem in _tree_problems(tokens, parents, depths, scores, counts, vocab):
            self._dt_fault("invalid_trees", f"the drafter returned an invalid tree ({problem})")
            counts[j] = 0
        counts, scores = counts.tolist(), scores.numpy()
        return counts, tokens, parents, depths, scores

    def _dt_fault(self, kind: str, message: str) -> None:
        self._dt_faults[kind] += 1
        if kind not in self._dt_fault_logged:
            self._dt_fault_logged.add(kind)
            logger.warning("dartree: %s; that request decodes without speculation this step "
                           "(logged once; counted in dartree_budget[%r])", message, kind)

    @staticmethod
    def _dt_estimate(budget: TreeBudget | None, rid, greedy: bool):
        """How lookup ranks a merged tree's nodes: the budget's calibrated acceptance, or,
        with a fixed budget, the prior exp(score) of every source."""
        if budget is None:
            return lambda scores, depths, sources: np.exp(scores)
        return lambda scores, depths, sources: budget.predict(rid, greedy, scores, depths,
                                                              sources)

    def _dt_context_for(self, drafter) -> LazyContext:
        """The drafter's context, extended lazily (`engine.lazy_context`)."""
        if self._dt_context is None or self._dt_context.drafter is not drafter:
            self._dt_context = LazyContext(drafter)
        return self._dt_context

    def _dt_budget_for(self, drafter) -> TreeBudget | None:
        """The adaptive budget (None with `adaptive: false`), made once the drafter is known."""
        if not self.dartree.config.adaptive:
            return None
        if self._dt_budget is None:
            self._dt_budget = TreeBudget(self.dartree.config.budget, drafter.num_depths)
        return self._dt_budget


def _tp_group():
    """vLLM's tensor-parallel group when it has more than one rank, else None."""
    from vllm.distributed import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    return group if group.world_size > 1 else None


def _tree_problems(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                   scores: torch.Tensor, counts: torch.Tensor, vocab: int) -> list[tuple[int, str]]:
    """(row, why) for every row of a drafted batch [R, N] whose first counts[r] nodes are not
    a verifiable tree; checked for the whole batch at once."""
    slot = torch.arange(tokens.shape[1])
    valid = slot[None, :] < counts[:, None]
    parent_depth = torch.where(parents >= 0, depths.gather(1, parents.clamp(min=0)), 0)
    checks = (("non-finite scores", ~torch.isfinite(scores)),
              ("token ids outside the vocabulary",
               (tokens < 0) | (tokens >= vocab) if vocab else tokens < 0),
              ("a parent that is not an earlier node", (parents < -1) | (parents >= slot)),
              ("depths that are not their parent's + 1", depths != parent_depth + 1))
    found: dict[int, str] = {}
    for why, bad in checks:
        for j in (bad & valid).any(dim=1).nonzero().flatten().tolist():
            found.setdefault(j, why)
    return sorted(found.items())
