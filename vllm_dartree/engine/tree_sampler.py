"""`TreeSamplerMixin`: the runner's sampling stage (stage 4 of a round): the tree walk.

The greedy or sampled walk (`vllm_dartree.tree.verify`) with each request's temperature,
top-k, top-p and seed, in the rejection sampler's output format (`[R, 1 + N]`, accepted
tokens + bonus, -1 padded). A batch holding a request that needs vLLM's full sampler
(`needs_full_sampler`) is sampled by vLLM's sampler from the root rows instead (all drafts
rejected: exact, only slower). Requests without a tree this step take vLLM's own sample, so
a seeded request's first token is plain decoding's. The walks label the verified nodes for
the adaptive budget's calibration.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_dartree.engine.tree_inputs import StepTrees
from vllm_dartree.tree import TreeBatch
from vllm_dartree.tree.verify import sample_target_tokens, walk

__all__ = ["TreeSamplerMixin", "needs_full_sampler", "position_noise"]


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



class TreeSamplerMixin:
    """Sampling for `DARTreeRunnerMixin` (uses its `_dt_step`, `_dt_budget`, `_dt_timed`)."""

    def _dt_full_sampler_batch(self, step: StepTrees) -> bool:
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
            stock = self.sampler(logits=logits[roots],
                                 sampling_metadata=self.input_batch.sampling_metadata)
            if not self._dt_full_sampler_batch(step):
                self._dt_seeded_roots(logits, step, offsets, stock.sampled_token_ids)
            return stock
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
            self._dt_seeded_roots(logits, step, offsets, sampled)
        counts = result.num_accepted.tolist()
        nodes = result.accepted_nodes.tolist()
        step.accepted = [nodes[i][:c] for i, c in enumerate(counts)]
        self._dt_observe_walks(step)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)

    def _dt_greedy(self, rid) -> bool:
        sp = getattr(self.requests.get(rid), "sampling_params", None)
        return sp is None or sp.temperature < 1e-5

    def _dt_observe_walks(self, step: StepTrees) -> None:
        """The calibration's data: each verified tree's nodes, labelled by the walk."""
        if self._dt_budget is None:
            return
        for rid, tree, accepted in zip(step.req_ids, step.trees, step.accepted):
            if tree is not None and tree.scores is not None and len(tree.tokens):
                self._dt_budget.observe_walk(rid, self._dt_greedy(rid), tree.scores,
                                             tree.depths.numpy(), accepted, tree.sources)

    def _dt_tree_batch(self, step: StepTrees, device) -> TreeBatch:
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

    def _dt_seeded_roots(self, logits, step: StepTrees, offsets, sampled) -> None:
        """Seeded sampled requests decoding without a tree this step: their token from the
        position-keyed noise too (in place in `sampled` [R, >= 1]), so that a seeded
        request's output does not depend on which of its steps were plain. The first token
        (the end of the prompt) stays vLLM's own draw."""
        own = [i for i, (rid, d) in enumerate(zip(step.req_ids, step.drafts))
               if not d and self._dt_seeded(rid) is not None and int(step.rows[i]) == 1
               and int(step.p0[i]) >= self.requests[rid].num_prompt_tokens]
        if own:
            tokens = self._dt_target_tokens(logits, step, offsets, own)
            for i in own:
                sampled[i, 0] = tokens[int(offsets[i])].to(sampled.dtype)

    def _dt_seeded(self, rid):
        """The sampling params of a seeded request at temperature > 0, else None."""
        sp = getattr(self.requests.get(rid), "sampling_params", None)
        if sp is None or sp.temperature < 1e-5 or sp.seed is None:
            return None
        return sp

    def _dt_target_tokens(self, logits: torch.Tensor, step: StepTrees, offsets,
                          requests: list[int] | None = None) -> torch.Tensor:
        """The target's token at every logits row: argmax, or a sample with the request's
        temperature / top-k / top-p. A seeded request's noise is keyed by (seed, position)
        (`position_noise`): the same whatever tree, step or batch a position is sampled in,
        so its output is reproducible under the adaptive budget; unseeded requests use the
        global generator. `requests`: only those (default: every request with a tree)."""
        tokens = logits.argmax(dim=-1)
        generators = self.input_batch.sampling_metadata.generators
        for i in range(len(step.req_ids)) if requests is None else requests:
            rid = step.req_ids[i]
            sp = getattr(self.requests.get(rid), "sampling_params", None)
            n = len(step.drafts[i])
            if sp is None or sp.temperature < 1e-5 or (requests is None and not n):
                continue   # greedy, or no tree (vLLM's sampler draws that request's token)
            lo, hi = int(offsets[i]), int(offsets[i]) + n + 1
            top_k = sp.top_k if sp.top_k and sp.top_k > 0 else 0
            dev = logits.device
            noise = None
            if sp.seed is not None:
                tree = step.trees[i]
                depths = [0] + (tree.depths.tolist() if tree is not None
                                else list(range(1, n + 1)))
                noise = position_noise(sp.seed, [int(step.p0[i]) + d for d in depths],
                                       logits.shape[-1], dev)[None]
            # top-k / top-p only when asked for: they sort the vocabulary of every row
            k = torch.tensor([top_k], device=dev) if top_k else None
            p = torch.tensor([float(sp.top_p)], device=dev) if sp.top_p < 1.0 else None
            tokens[lo:hi] = sample_target_tokens(
                logits[lo:hi][None], torch.tensor([float(sp.temperature)], device=dev), k, p,
                [generators.get(i)], noise=noise)[0]
        return tokens


def position_noise(seed: int, positions: list[int], vocab: int, device) -> torch.Tensor:
    """Exp(1) noise [len(positions), V] of a seeded request, one row per sequence position,
    a pure function of (seed, position). Exact: the walk reads one node per depth, i.e. one
    row per position, and rows of different positions are independent."""
    rows = torch.empty(len(positions), vocab, device=device)
    gen = torch.Generator(device=device)
    for j, p in enumerate(positions):
        gen.manual_seed((int(seed) * 0x9E3779B97F4A7C15 + int(p)) % (2**63 - 1))
        rows[j].exponential_(generator=gen)
    return rows
