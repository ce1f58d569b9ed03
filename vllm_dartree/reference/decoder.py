"""A speculative decoder on Hugging Face transformers: the correctness oracle for the engines
and the CPU benchmark for every method of the paper (Tables 1 and 2) on one drafter.

One request at a time (the paper's batch size 1). A round:
1. draft: the drafter's backbone pass from the root (the last committed token);
2. build: the tree for this method (`vllm_dartree.tree.build_tree`);
3. verify: ONE target forward over `[root] + nodes` at positions `p0 + depth` with a 4D mask
   (committed context + ancestors + self), appended to the target's KV cache;
4. walk (greedy or sampled) -> accepted nodes + bonus; stop at EOS / max_new_tokens inside
   the path; commit: keep only the root's and the accepted nodes' K/V (moved to the front of
   the round's window), and hand their target features to the drafter as new context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_dartree.config import DARTreeConfig
from vllm_dartree.drafter import ContextCache, Drafter, DraftOutput
from vllm_dartree.reference.stats import RequestResult, RoundStats
from vllm_dartree.tree import (
    ancestor_mask,
    build_tree,
    greedy_walk,
    sample_target_tokens,
    sampled_walk,
)

__all__ = ["METHODS", "method_config", "DraftModel", "DrafterSession", "ReferenceDecoder",
           "SamplingParams", "compact_cache", "load_drafter_for", "eos_token_ids"]

METHODS: dict[str, DARTreeConfig | None] = {
    "ar": None,
    "dflash": DARTreeConfig(builder="chain", correction=False),
    "domino": DARTreeConfig(builder="chain"),
    "ddtree": DARTreeConfig(builder="ddtree"),
    "dartree-fixed": DARTreeConfig(variant="fixed"),
    "dartree-pruned": DARTreeConfig(),
    "sequential-heap": DARTreeConfig(builder="sequential-heap"),
    "domino-chain+ddtree": DARTreeConfig(builder="chain-ddtree"),
}


def method_config(method: str, **overrides) -> DARTreeConfig | None:
    """The DARTreeConfig of a method name, with user overrides (budget, width, ...)."""
    if method not in METHODS:
        raise ValueError(f"method = {method!r} must be one of {sorted(METHODS)}")
    base = METHODS[method]
    if base is None:
        return None
    given = {k: v for k, v in overrides.items() if v is not None}
    return DARTreeConfig(**(base.model_dump() | given))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0          # 0: off
    top_p: float = 1.0      # 1.0: off
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()


class DraftModel(Protocol):
    """What the decoder needs from a drafter for one request."""
    head: object | None
    layer_ids: tuple[int, ...]   # target layers (0-based) whose outputs are the context

    def extend(self, tokens: list[int], features: torch.Tensor) -> None: ...

    def draft(self, root: int) -> DraftOutput: ...


class DrafterSession:
    """A loaded drafter serving one request: its context cache lives here."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.head = drafter, drafter.head
        self.layer_ids = drafter.spec.target_layer_ids
        self.cache = ContextCache()

    def extend(self, tokens: list[int], features: torch.Tensor) -> None:
        self.drafter.backbone.extend_context(self.cache, [0], [features])

    def draft(self, root: int) -> DraftOutput:
        device = self.drafter.backbone.embed_weight.device
        return self.drafter.backbone(self.cache, [0], torch.tensor([root], device=device))


def load_drafter_for(target: torch.nn.Module, folder, dtype: torch.dtype | None = None):
    """The drafter in `folder`, checked against and sharing the embeddings / lm_head of a
    transformers target model."""
    from vllm_dartree.drafter import TargetInfo, load_drafter
    cfg = target.config
    return load_drafter(folder, TargetInfo(cfg.hidden_size, cfg.vocab_size,
                                           cfg.num_hidden_layers),
                        target.get_input_embeddings().weight,
                        target.get_output_embeddings().weight, dtype=dtype)


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS and the generation config's EOS ids, sorted."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return tuple(sorted(i for i in ids if i is not None))


def compact_cache(cache, start: int, keep: torch.Tensor) -> None:
    """Keep only window positions `keep` (relative to `start`) of every layer's K/V."""
    for layer in cache.layers:
        if getattr(layer, "sliding_window", None):
            raise NotImplementedError("KV compaction of sliding-window layers is not supported")
        layer.keys = torch.cat([layer.keys[..., :start, :],
                                layer.keys[..., start:, :].index_select(-2, keep)], dim=-2)
        layer.values = torch.cat([layer.values[..., :start, :],
                                  layer.values[..., start:, :].index_select(-2, keep)], dim=-2)


def _features(hidden_states, layer_ids, cols: torch.Tensor | None = None) -> torch.Tensor:
    """The drafter's context features [T, n*H]: outputs of target layers l (hidden_states[l+1])."""
    rows = [hidden_states[l + 1][0] for l in layer_ids]
    feats = torch.cat(rows, dim=-1)
    return feats if cols is None else feats[cols]


class ReferenceDecoder:
    def __init__(self, target: torch.nn.Module, draft_model: DraftModel | None = None,
                 config: DARTreeConfig | None = None):
        if config is not None and draft_model is None:
            raise ValueError("a tree method needs a drafter; use method 'ar' without one")
        self.target, self.draft_model, self.config = target, draft_model, config
        self.device = next(target.parameters()).device

    def _sample(self, logits: torch.Tensor, p: SamplingParams, gen) -> int:
        """logits [V] -> one target token under the request's sampling parameters."""
        tok = sample_target_tokens(logits[None, None], torch.tensor([p.temperature]),
                                   torch.tensor([p.top_k]), torch.tensor([p.top_p]), [gen])
        return int(tok[0, 0])

    @torch.no_grad()
    def generate(self, prompt: list[int], params: SamplingParams, cache=None) -> RequestResult:
        """Decode one request. `cache` (a fresh transformers DynamicCache) may be passed in to
        inspect the target's KV cache afterwards."""
        from transformers import DynamicCache

        gen = torch.Generator(device=self.device).manual_seed(params.seed)
        cache = DynamicCache() if cache is None else cache
        ids = torch.tensor([prompt], device=self.device)
        want_hidden = self.config is not None
        out = self.target(ids, past_key_values=cache, use_cache=True,
                          output_hidden_states=want_hidden)
        result = RequestResult(prompt_tokens=list(prompt), output_tokens=[])
        start = time.perf_counter()
        token = self._sample(out.logits[0, -1].float(), params, gen)
        done = self._emit(result, [token], params)
        if want_hidden:
            self.draft_model.extend(list(prompt), _features(out.hidden_states,
                                                            self.draft_model.layer_ids))
        while not done:
            if want_hidden:
                done = self._tree_round(result, cache, token, params, gen)
                token = result.output_tokens[-1]
            else:
                out = self.target(torch.tensor([[token]], device=self.device),
                                  past_key_values=cache, use_cache=True)
                token = self._sample(out.logits[0, -1].float(), params, gen)
                done = self._emit(result, [token], params)
        result.seconds = time.perf_counter() - start
        return result

    def _emit(self, result: RequestResult, tokens: list[int], p: SamplingParams) -> bool:
        """Append tokens up to EOS (included) or max_new_tokens; True when the request ends."""
        for tok in tokens:
            result.output_tokens.append(tok)
            if tok in p.eos_token_ids:
                result.finish_reason = "stop"
                return True
            if len(result.output_tokens) >= p.max_new_tokens:
                return True
        return False

    def _tree_round(self, result, cache, root: int, p: SamplingParams, gen) -> bool:
        t = [time.perf_counter()]
        drafted = self.draft_model.draft(root)
        t.append(time.perf_counter())
        roots = torch.tensor([root], device=self.device)
        tree = build_tree(self.config, drafted.base_logits, drafted.hidden, roots,
                          self.draft_model.head, drafted.vocab_ids)
        n = int(tree.num_nodes[0])
        tree = tree.narrow(n)
        t.append(time.perf_counter())
        p0 = cache.get_seq_length()
        mask = ancestor_mask(tree.parents)                                   # [1, 1+N, 1+N]
        visible = torch.cat([mask.new_ones(1, 1 + n, p0), mask], dim=2)
        dtype = next(self.target.parameters()).dtype
        additive = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        additive.masked_fill_(~visible, torch.finfo(dtype).min)
        ids = torch.cat([roots[:, None], tree.tokens], dim=1)
        positions = p0 + torch.cat([tree.depths.new_zeros(1, 1), tree.depths], dim=1)
        out = self.target(ids, position_ids=positions, attention_mask=additive[:, None],
                          past_key_values=cache, use_cache=True, output_hidden_states=True)
        logits = out.logits.float()
        if p.temperature > 0:
            walk = sampled_walk(tree, logits, torch.tensor([p.temperature]),
                                torch.tensor([p.top_k]), torch.tensor([p.top_p]), [gen], mask)
        else:
            walk = greedy_walk(tree, logits, mask)
        t.append(time.perf_counter())
        num = int(walk.num_accepted[0])
        nodes = walk.accepted_nodes[0, :num]
        new = tree.tokens[0, nodes].tolist() + [int(walk.bonus_tokens[0])]
        done = self._emit(result, new, p)
        keep = torch.cat([nodes.new_zeros(1), nodes + 1])                  # root + accepted
        compact_cache(cache, p0, keep)
        if not done:
            committed = [root] + new[:-1]
            self.draft_model.extend(committed, _features(out.hidden_states,
                                                         self.draft_model.layer_ids, keep))
        t.append(time.perf_counter())
        depth = int(tree.depths.max()) if n else 0
        stages = dict(zip(("draft", "build", "verify", "commit"),
                          (b - a for a, b in zip(t, t[1:]))))
        result.rounds.append(RoundStats(accepted=num, tree_nodes=n, tree_depth=depth,
                                        seconds=stages))
        return done
