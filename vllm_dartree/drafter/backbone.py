"""The block-diffusion drafter backbone (DFlash architecture) and its per-request context cache.

Data flow of one round (z-lab/dflash; research/drafters.md, section 1):
- context: target hidden states of `target_layer_ids` for the committed tokens,
  concatenated [T, n*H] -> `hidden_norm(fc(.))` [T, H] -> every layer's k_proj / v_proj
  (+ k_norm, RoPE at the tokens' positions) -> cached per request and layer; the drafter
  never runs its layers over context tokens.
- query block: embed([root, MASK, ...]) at positions p0 .. p0 + Q - 1 (p0 = number of
  context tokens = the root's position); every layer attends to [context K/V ; block K/V],
  non-causally; final `norm`. Depth d's hidden is slot `depth_offset + d - 1`; base logits
  come from the target's lm_head (shared, not copied), or from its rows of a reduced draft
  vocabulary (`set_draft_vocab`: logit column j scores target token `draft_vocab[j]`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vllm_dartree.drafter.layers import DraftLayer, RMSNorm, linear, rope_cos_sin
from vllm_dartree.drafter.spec import DrafterSpec

__all__ = ["ContextCache", "DFlashBackbone", "DraftOutput"]


@dataclass(frozen=True, slots=True)
class DraftOutput:
    hidden: torch.Tensor       # [R, D, H] backbone hidden state per draft depth (after norm)
    base_logits: torch.Tensor  # [R, D, V] lm_head(hidden) (V = the draft vocabulary's size)
    vocab_ids: torch.Tensor | None = None   # [V] target ids of the logits' columns (None:
    #                                         the columns are the target's vocabulary)


class ContextCache:
    """Context K/V of every live request: per request [layers, KVH, capacity, D] buffers that
    grow by the accepted tokens each round (amortised doubling) and can be trimmed."""

    def __init__(self) -> None:
        self._k: dict[Hashable, torch.Tensor] = {}
        self._v: dict[Hashable, torch.Tensor] = {}
        self._len: dict[Hashable, int] = {}

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._len

    def __len__(self) -> int:
        """Live requests (those not freed)."""
        return len(self._len)

    def length(self, rid: Hashable) -> int:
        """Context tokens of request rid (= the position of its next root)."""
        return self._len.get(rid, 0)

    def trim(self, rid: Hashable, length: int) -> None:
        if not 0 <= length <= self.length(rid):
            raise ValueError(f"cannot trim request {rid!r} to {length} tokens "
                             f"(it has {self.length(rid)})")
        self._len[rid] = length

    def free(self, rid: Hashable) -> None:
        for store in (self._k, self._v, self._len):
            store.pop(rid, None)

    def append(self, rid: Hashable, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [layers, KVH, T, D] for the next T positions of request rid."""
        n, t = self.length(rid), k.shape[2]
        buf_k = self._k.get(rid)
        if buf_k is None or buf_k.shape[2] < n + t:
            cap = max(16, 2 * (n + t))
            new_k = k.new_empty(*k.shape[:2], cap, k.shape[3])
            new_v = v.new_empty(*v.shape[:2], cap, v.shape[3])
            if buf_k is not None:
                new_k[:, :, :n] = buf_k[:, :, :n]
                new_v[:, :, :n] = self._v[rid][:, :, :n]
            self._k[rid], self._v[rid] = new_k, new_v
        self._k[rid][:, :, n:n + t] = k
        self._v[rid][:, :, n:n + t] = v
        self._len[rid] = n + t

    def gather(self, rids: Sequence[Hashable], like: torch.Tensor):
        """Padded batch: K, V [layers, R, KVH, Lmax, D] and valid [R, Lmax] bool."""
        longest = max((self.length(r) for r in rids), default=0)
        some = next((self._k[r] for r in rids if r in self._k), None)
        if some is None:   # nobody has context yet
            shape = (0, len(rids), 0, longest, 0)
            empty = like.new_zeros(shape)
            return empty, empty, torch.zeros(len(rids), 0, dtype=torch.bool, device=like.device)
        layers, kvh, _, dim = some.shape
        k = some.new_zeros(layers, len(rids), kvh, longest, dim)
        v = torch.zeros_like(k)
        valid = torch.zeros(len(rids), longest, dtype=torch.bool, device=some.device)
        for i, rid in enumerate(rids):   # host-side assembly: a reference engine's cache
            n = self.length(rid)
            if n:
                k[:, i, :, :n] = self._k[rid][:, :, :n]
                v[:, i, :, :n] = self._v[rid][:, :, :n]
                valid[i, :n] = True
        return k, v, valid


class DFlashBackbone(nn.Module):
    """Qwen3 draft layers + fc/hidden_norm/norm; embeddings and lm_head belong to the target."""

    def __init__(self, spec: DrafterSpec, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor):
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(
            DraftLayer(spec.hidden_size, spec.intermediate_size, spec.num_heads,
                       spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps)
            for _ in range(spec.num_layers))
        self.fc = nn.Linear(len(spec.target_layer_ids) * spec.hidden_size, spec.hidden_size,
                            bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # Shared with the target, not parameters of ours (never saved, never copied).
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()
        self.mask_embedding: nn.Parameter | None = None   # some checkpoints ship their own
        self.draft_vocab: torch.Tensor | None = None      # [N] int64 target ids, or None
        self._draft_head: torch.Tensor | None = None       # lm_head rows of draft_vocab

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Score only the target tokens `ids` ([N] int64, strictly increasing); None: all.
        The N lm_head rows are copied once (N x H), on the lm_head's device."""
        if ids is None:
            self.draft_vocab = self._draft_head = None
            return
        ids = ids.to(device=self.lm_head_weight.device, dtype=torch.long)
        self.draft_vocab, self._draft_head = ids, self.lm_head_weight[ids].contiguous()

    def draft_columns(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids -> their logit columns; -1 for tokens outside the draft vocabulary
        (identity without one). Negative inputs (ignored labels) stay -1."""
        if self.draft_vocab is None:
            return torch.where(tokens >= 0, tokens, -1)
        found = torch.searchsorted(self.draft_vocab, tokens.clamp(min=0))
        found = found.clamp(max=self.draft_vocab.shape[0] - 1)
        inside = (self.draft_vocab[found] == tokens) & (tokens >= 0)
        return torch.where(inside, found, -1)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output projection: the target's lm_head, or its rows of the draft vocabulary."""
        return self.lm_head_weight if self._draft_head is None else self._draft_head

    def _output_weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """`output_weight` in the drafter's dtype, cast once (the target's lm_head stays in
        the target's dtype; a drafter run in bf16 beside an fp32 target would otherwise
        cast its rows every pass)."""
        weight = self.output_weight
        if weight.dtype == dtype:
            return weight
        cached = self.__dict__.get("_output_cast")
        if cached is None or cached[0] is not weight or cached[1].dtype != dtype:
            cached = self._output_cast = (weight, weight.to(dtype))
        return cached[1]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.spec.head_dim, self.spec.rope_theta, dtype)

    @torch.no_grad()
    def extend_context(self, cache: ContextCache, rids: Sequence[Hashable],
                       target_hidden: Sequence[torch.Tensor]) -> None:
        """Append each request's new context tokens: target_hidden[i] is [T_i, n*H], the
        concatenated outputs of the target layers `spec.target_layer_ids`."""
        counts = [int(h.shape[0]) for h in target_hidden]
        if sum(counts) == 0:
            return
        dtype = self.fc.weight.dtype
        concat = torch.cat(list(target_hidden)).to(dtype)                     # [T, n*H]
        feats = self.hidden_norm(linear(concat, self.fc.weight))              # [T, H]
        positions = torch.cat([cache.length(r) + torch.arange(n) for r, n in zip(rids, counts)])
        cos, sin = self._rope(positions.to(feats.device), dtype)
        keys, values = zip(*(layer.self_attn.keys_values(feats, cos, sin)
                             for layer in self.layers))
        k_all, v_all = torch.stack(keys), torch.stack(values)         # [layers, KVH, T, D]
        for rid, k, v in zip(rids, k_all.split(counts, dim=2), v_all.split(counts, dim=2)):
            if k.shape[2]:
                cache.append(rid, k, v)

    @torch.no_grad()
    def forward(self, cache: ContextCache, rids: Sequence[Hashable],
                root_tokens: torch.Tensor, num_depths: int | None = None) -> DraftOutput:
        """One draft pass for R requests: root_tokens [R] -> per-depth hiddens and logits.

        `num_depths` (default all) limits the depths projected onto the vocabulary: the
        lm-head is most of a small drafter's cost, and a tree cut to n nodes needs <= n."""
        spec = self.spec
        dtype = self.fc.weight.dtype
        num_req, q = len(rids), spec.query_len
        block = torch.full((num_req, q), spec.mask_token_id, dtype=torch.long,
                           device=root_tokens.device)
        block[:, 0] = root_tokens
        x = self.embed_weight[block].to(dtype)                        # [R, Q, H]
        if self.mask_embedding is not None:
            x[:, 1:] = self.mask_embedding.to(dtype).reshape(-1)
        p0 = torch.tensor([cache.length(r) for r in rids], device=x.device)
        cos, sin = self._rope(p0[:, None] + torch.arange(q, device=x.device), dtype)
        ctx_k, ctx_v, valid = cache.gather(rids, x)
        depths = spec.num_depths if num_depths is None else min(num_depths, spec.num_depths)
        # the last layer computes only the block positions read out (its keys and values
        # still come from the whole block): the same rows, a fraction of its cost
        read = slice(spec.depth_offset, spec.depth_offset + depths)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            k_i = ctx_k[i] if ctx_k.shape[0] else x.new_zeros(num_req, spec.num_kv_heads, 0,
                                                                spec.head_dim)
            v_i = ctx_v[i] if ctx_v.shape[0] else k_i
            x = layer(x, k_i, v_i, valid, cos, sin, queries=read if i == last else None)
        hidden = self.norm(x)
        logits = linear(hidden, self._output_weight_as(hidden.dtype))
        return DraftOutput(hidden=hidden, base_logits=logits, vocab_ids=self.draft_vocab)

    def anchored_forward(self, target_hidden: torch.Tensor, tokens: torch.Tensor,
                         anchors: torch.Tensor) -> torch.Tensor:
        """Teacher-forced blocks for training (DFlash / SpecForge recipe), with gradients.

        One sequence: target_hidden [T, n*H] (the target's features of every token), tokens
        [T], anchors [A] positions. Block a is [tokens[anchor_a], MASK, ...] at positions
        anchor_a + arange(Q); it sees the context features of positions < anchor_a and its
        own block, exactly as `forward` does at inference with a context of anchor_a tokens.
        Returns the per-depth hidden states [A, D, H] (after the final norm).
        """
        spec = self.spec
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(linear(target_hidden.to(dtype), self.fc.weight))   # [T, H]
        num_ctx, q = ctx.shape[0], spec.query_len
        cos_c, sin_c = self._rope(torch.arange(num_ctx, device=ctx.device), dtype)
        block = torch.full((anchors.shape[0], q), spec.mask_token_id, dtype=torch.long,
                           device=tokens.device)
        block[:, 0] = tokens[anchors]
        x = self.embed_weight[block].to(dtype)                                    # [A, Q, H]
        if self.mask_embedding is not None:
            x = torch.cat([x[:, :1], self.mask_embedding.to(dtype).expand(x.shape[0], q - 1, -1)],
                          dim=1)
        cos, sin = self._rope(anchors[:, None] + torch.arange(q, device=x.device), dtype)
        valid = torch.arange(num_ctx, device=x.device)[None, :] < anchors[:, None]  # [A, T]
        for layer in self.layers:
            k, v = layer.self_attn.keys_values(ctx, cos_c, sin_c)                 # [KVH, T, D]
            expand = (anchors.shape[0], *k.shape)
            x = layer(x, k.expand(expand), v.expand(expand), valid, cos, sin)
        return self.norm(x)[:, spec.depth_offset:spec.depth_offset + spec.num_depths]
