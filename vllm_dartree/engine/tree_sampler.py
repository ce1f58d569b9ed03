"""`TreeSamplerMixin`: the runner's sampling stage (stage 4 of a round): the tree walk.

The greedy or sampled walk (`vllm_dartree.tree.verify`) with each request's temperature,
top-k, top-p and seed, in the rejection sampler's output format (`[R, 1 + N]`, accepted
tokens + bonus, -1 padded). A request that needs vLLM's sampler (`full_sampler_fields`, an
allow-list of what the walk implements) verifies no tree and takes vLLM's sample from its
root row, alone; so do requests without a tree this step, and a seeded request's first
token is plain decoding's. When some request asks for logprobs, vLLM's logprobs of the root
rows come back in the output grid's first column. The walks label the verified nodes for
the adaptive budget's calibration.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_dartree import ops
from vllm_dartree.engine.tree_inputs import StepTrees
from vllm_dartree.tree import TreeBatch
from vllm_dartree.tree.verify import sample_target_tokens, walk

__all__ = ["TreeSamplerMixin", "full_sampler_fields", "needs_full_sampler", "position_noise",
           "top_probability"]


def top_probability(logits: torch.Tensor, rows) -> np.ndarray:
    """The probability of the likeliest token at each of `rows` of `logits` [T, V] (the
    softmax at temperature 1), on the host: the adaptive budget's confidence signal."""
    sel = logits.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=logits.device))
    # 1 / sum(exp(l - max)): amax and one exp pass (one thread here: about 60 us a row of
    # 49,152 logits; `max` with indices and `logsumexp` took 2.7x that)
    shifted = sel.float() - sel.amax(-1, keepdim=True).float()
    return (1.0 / shifted.exp_().sum(-1)).cpu().numpy()


# SamplingParams fields the tree walk implements (`tree.verify`: temperature, top-k, top-p,
# position-keyed seeds) ...
WALK_FIELDS = frozenset({"temperature", "top_p", "top_k", "seed"})
# ... and fields that never change which token a position gets: how many outputs, when to
# stop (the scheduler checks every accepted token), what is returned and how, prompt
# logprobs (computed from the prompt rows, which are never tree rows), prefix-cache use,
# the V2 runner's watermark (our runner is V1's), routing traces.
NEUTRAL_FIELDS = frozenset({
    "n", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "prompt_logprobs",
    "prompt_logprob_token_ids", "prompt_logprob_start", "flat_logprobs", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "stream_interval", "skip_clone", "output_text_buffer_length",
    "_eos_token_id", "_all_stop_token_ids", "watermarking", "_watermarking_skipped",
    "skip_reading_prefix_cache", "routed_experts_prompt_start"})


def _unset(value, default) -> bool:
    if value is None or value is default:
        return True
    try:
        if value == default:
            return True
    except Exception:   # noqa: BLE001 - arrays and other values without a plain ==
        return False
    # post-init turns None into empty containers (stop, stop_token_ids, bad_words)
    return default is None and isinstance(value, (list, tuple, set, dict, str)) and not value


def full_sampler_fields(sp) -> list[str]:
    """The fields of `sp` that need vLLM's sampler: an allow-list, so that anything the walk
    does not implement (penalties, logprobs, min_p, bad words, structured output, custom
    logits processors' `extra_args`, `thinking_token_budget`, any field a later vLLM adds)
    takes the exact path. `min_tokens` counts only while stop tokens exist to suppress."""
    if sp is None:
        return []
    names = getattr(type(sp), "__struct_fields__", None)
    if names is None:   # not vLLM's msgspec struct: treat every public attribute as set
        names = tuple(k for k in vars(sp) if not k.startswith("__"))
        defaults = (object(),) * len(names)
    else:
        defaults = type(sp).__struct_defaults__
        defaults = (object(),) * (len(names) - len(defaults)) + tuple(defaults)
    out = []
    for name, default in zip(names, defaults):
        if name in WALK_FIELDS or name in NEUTRAL_FIELDS:
            continue
        value = getattr(sp, name, None)
        if name == "min_tokens":
            if value and (getattr(sp, "all_stop_token_ids", None) or sp.stop_token_ids):
                out.append(name)
            continue
        if not _unset(value, default if not callable(default) else None):
            out.append(name)
    return out


def needs_full_sampler(sp) -> bool:
    """Whether a request must be sampled by vLLM's sampler (`full_sampler_fields`)."""
    return bool(full_sampler_fields(sp))


class TreeSamplerMixin:
    """Sampling for `DARTreeRunnerMixin` (uses its `_dt_step`, `_dt_budget`, `_dt_timed`)."""

    def _dt_needs_full(self, rid) -> bool:
        """Request rid is sampled by vLLM's sampler alone (no tree): it asks for something
        the walk does not implement, or custom logits processors are installed (they may
        apply to any request)."""
        if getattr(self, "_dt_custom_logitsprocs", ()):
            return True
        cache = self.__dict__.setdefault("_dt_full_cache", {})   # per request: its params
        state = self.requests.get(rid)                           # never change
        sp = getattr(state, "sampling_params", None)
        hit = cache.get(rid)
        if hit is None or hit[0] is not sp:
            hit = cache[rid] = (sp, needs_full_sampler(sp))
        return hit[1]

    def _sample(self, logits, spec_decode_metadata):
        self._dt_save_discarded_generators()
        with self._dt_timed("walk"):
            return self._dt_sample(logits, spec_decode_metadata)

    def _dt_save_discarded_generators(self) -> None:
        """Seeded requests in a partial prefill sample a token that is discarded; vLLM then
        rewinds their generator with `set_offset`, which CPU generators do not have (stock
        vLLM on CPU dies there: "CPU Generator does not use offset"). Their state is saved
        here, before sampling, and restored in `_bookkeeping_sync` instead."""
        self._dt_rewind = {}
        mask = getattr(self, "discard_request_mask", None)
        if mask is None:
            return
        generators = self.input_batch.generators
        for i in np.nonzero(mask.np[:self.input_batch.num_reqs])[0].tolist():
            gen = generators.get(int(i))
            if gen is not None and gen.device.type == "cpu":
                self._dt_rewind[int(i)] = (gen, gen.get_state())

    def _bookkeeping_sync(self, *args, **kwargs):
        rewind, self._dt_rewind = getattr(self, "_dt_rewind", {}), {}
        generators = self.input_batch.generators
        held = {}
        for i, (gen, state) in rewind.items():
            if generators.get(i) is gen:      # restored here; hidden from vLLM's set_offset
                gen.set_state(state)
                held[i] = generators.pop(i)
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(held)

    def _dt_sample(self, logits, spec_decode_metadata):
        step = self._dt_step
        if spec_decode_metadata is None or step is None:
            if step is not None and logits.shape[0] == len(step.req_ids):
                self._dt_confidence(logits, step, range(len(step.req_ids)))
            return super()._sample(logits, spec_decode_metadata)
        from vllm.v1.outputs import LogprobsTensors, SamplerOutput

        full = [self._dt_needs_full(rid) for rid in step.req_ids]
        # a request that needs vLLM's sampler verifies no tree (it is never proposed one;
        # drafts it holds anyway are all rejected): its row is vLLM's sample, alone
        num = [0 if f else len(d) for d, f in zip(step.drafts, full)]
        width1 = 1 + max([len(d) for d in step.drafts] + [0])
        offsets = np.concatenate([[0], np.cumsum(
            np.asarray([len(d) for d in step.drafts]) + 1)[:-1]]).astype(np.int64)
        roots = torch.as_tensor(offsets, device=logits.device)
        if not any(num):
            # No tree to walk (prefills, plain steps, requests that need vLLM's sampler):
            # vLLM's own sampler from the root rows, as without speculation (the same
            # seeded draws)
            step.accepted = [[] for _ in num]
            self._dt_confidence(logits, step, offsets)
            self.input_batch.update_async_output_token_ids()
            metadata = self.input_batch.sampling_metadata
            # without drafts the root rows are every row, in order: an all-greedy batch
            # hands vLLM's sampler the logits themselves, as without speculation (0.45 ms
            # of copying at 16 requests here); otherwise a copy, since the sampler may scale
            # it in place and the seeded requests' draws below read the logits again
            rows = logits if metadata.all_greedy and logits.shape[0] == len(num) \
                else logits[roots]
            stock = self.sampler(logits=rows, sampling_metadata=metadata)
            self._dt_seeded_roots(logits, step, offsets, stock.sampled_token_ids, full)
            return stock
        targets = self._dt_target_tokens(logits, step, offsets)
        tree = self._dt_tree_batch(step, logits.device, num)
        cols = torch.arange(1 + tree.max_nodes, device=logits.device)
        index = roots[:, None] + torch.minimum(
            cols[None, :], torch.as_tensor(num, device=logits.device)[:, None])
        result = walk(tree, targets[index])
        sampled = torch.full((len(num), width1), -1, dtype=torch.int32, device=logits.device)
        walked = result.output_tokens(tree).to(torch.int32)
        sampled[:, :walked.shape[1]] = walked
        plain_rows = [i for i, n in enumerate(num) if n == 0]
        logprobs = None
        if plain_rows:   # requests without a tree this step: vLLM's sampler, as without
            metadata = self.input_batch.sampling_metadata   # speculation
            # the tree requests' seeded streams must not depend on who shared their step
            saved = {i: g.get_state() for i, g in metadata.generators.items() if num[i]}
            self.input_batch.update_async_output_token_ids()
            stock = self.sampler(logits=logits[roots], sampling_metadata=metadata)
            for i, state in saved.items():
                metadata.generators[i].set_state(state)
            rows = torch.as_tensor(plain_rows, device=logits.device)
            sampled[rows, 0] = stock.sampled_token_ids[rows, 0].to(torch.int32)
            self._dt_seeded_roots(logits, step, offsets, sampled, full)
            if stock.logprobs_tensors is not None:
                # the runner reads logprobs in the [R, 1 + N] grid of the output tokens; only
                # requests that asked for them (plain rows) are read, at column 0
                def grid(t):
                    out = t.new_zeros((len(num) * width1, *t.shape[1:]))
                    out[::width1] = t
                    return out
                lp = stock.logprobs_tensors
                logprobs = LogprobsTensors(grid(lp.logprob_token_ids), grid(lp.logprobs),
                                           grid(lp.selected_token_ranks))
        counts = result.num_accepted.tolist()
        nodes = result.accepted_nodes.tolist()
        step.accepted = [nodes[i][:c] if num[i] else [] for i, c in enumerate(counts)]
        # the row each request's last token was sampled from: its last accepted node's
        self._dt_confidence(logits, step, [int(offsets[i]) + (1 + acc[-1] if acc else 0)
                                           for i, acc in enumerate(step.accepted)])
        self._dt_observe_walks(step, num)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)

    def _dt_confidence(self, logits: torch.Tensor, step: StepTrees, rows) -> None:
        """step.confidence: `top_probability` at each request's last sampled row, for the
        adaptive budget's next plan; computed only when the budget uses it
        (`VLLM_DARTREE_CONFIDENCE=1`)."""
        budget = getattr(self, "_dt_budget", None)
        if budget is not None and budget.use_confidence:
            step.confidence = top_probability(logits, list(rows))

    def _dt_greedy(self, rid) -> bool:
        sp = getattr(self.requests.get(rid), "sampling_params", None)
        return sp is None or sp.temperature < 1e-5

    def _dt_observe_walks(self, step: StepTrees, num: list[int]) -> None:
        """The calibration's data: each verified tree's nodes, labelled by the walk."""
        if self._dt_budget is None:
            return
        self._dt_budget.observe_walks([
            (rid, self._dt_greedy(rid), tree.scores, tree.depths.numpy(), accepted, tree.sources)
            for rid, tree, accepted, n in zip(step.req_ids, step.trees, step.accepted, num)
            if n and tree is not None and tree.scores is not None and len(tree.tokens)])

    def _dt_tree_batch(self, step: StepTrees, device, num: list[int]) -> TreeBatch:
        """The step's trees as a batch; request i keeps its first num[i] drafts (0: none)."""
        num_reqs = len(step.req_ids)
        width = max(1, max(num))
        tokens = torch.zeros(num_reqs, width, dtype=torch.long)
        parents = torch.full((num_reqs, width), -1, dtype=torch.long)
        depths = torch.zeros(num_reqs, width, dtype=torch.long)
        for i, (draft, tree) in enumerate(zip(step.drafts, step.trees)):
            n = num[i]
            if not n:
                continue
            tokens[i, :n] = torch.tensor(draft[:n])
            if tree is not None:
                parents[i, :n], depths[i, :n] = tree.parents[:n], tree.depths[:n]
            else:   # a chain: scheduler padding (-1) or a draft we do not know
                parents[i, :n] = torch.arange(-1, n - 1)
                depths[i, :n] = torch.arange(1, n + 1)
        scores = torch.zeros(num_reqs, width)
        return TreeBatch(tokens.to(device), parents.to(device), depths.to(device),
                         scores.to(device), torch.tensor(num, dtype=torch.long).to(device))

    def _dt_seeded_roots(self, logits, step: StepTrees, offsets, sampled,
                         full: list[bool]) -> None:
        """Seeded sampled requests decoding without a tree this step: their token from the
        position-keyed noise too (in place in `sampled` [R, >= 1]), so that a seeded
        request's output does not depend on which of its steps were plain. The first token
        (the end of the prompt) stays vLLM's own draw, and so do requests that need vLLM's
        sampler (`full`): all their tokens are its draws, as in plain decoding."""
        own = [i for i, (rid, d) in enumerate(zip(step.req_ids, step.drafts))
               if not d and not full[i] and self._dt_seeded(rid) is not None and int(step.rows[i]) == 1
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
        tokens = ops.argmax(logits)
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
