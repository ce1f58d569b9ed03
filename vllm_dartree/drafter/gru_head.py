"""Domino's GRU correction head (jianuo-huang/Domino; facts in research/drafters.md, section 2).

Per draft depth d with backbone hidden z_d and path state s (GRU over the target's input
embeddings of the tokens chosen so far, starting from embed(root)):

    logits_d = lm_head(z_d) + W2 . SiLU(W1 . [z_d ; s])
    s'       = GRUCell(embed(token), s)          (PyTorch gate order r, z, n; no biases)

Implements the correction-head contract of `vllm_dartree.tree.heads`: the W1 half that reads
z_d is applied once per round (`prepare`), and W2 is evaluated only on the K candidate rows.
Weight names follow the released checkpoints: `prefix_gru.weight_{ih,hh}_l0`,
`embed_proj.0.weight` (W1, [E, H + G]) and `embed_proj.2.weight` (W2, [V, E]). With a
reduced draft vocabulary V is its size N: W2's rows follow the backbone's logit columns
(`prepare` is given those columns), while the GRU reads the target's embeddings of the
tokens themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_dartree.drafter.layers import linear

__all__ = ["DominoGRUHead", "GRUPrepared"]


@dataclass(frozen=True, slots=True)
class GRUPrepared:
    z_proj: torch.Tensor   # [R, D, E], W1[:, :H] . z_d for every depth
    cand_w2: torch.Tensor  # [R, D, K, E], the W2 rows of each depth's candidates


class DominoGRUHead(nn.Module):
    """Bias-free GRU + SiLU MLP correction; depth 1 is left uncorrected (prefix length 1)."""

    def __init__(self, hidden_size: int, gru_hidden_size: int, emb_dim: int, vocab_size: int,
                 embed_weight: torch.Tensor, num_uncorrected: int = 1):
        super().__init__()
        if embed_weight.dim() != 2 or embed_weight.shape[1] != hidden_size:
            raise ValueError(f"embed_weight {tuple(embed_weight.shape)} must be "
                             f"[target vocabulary, hidden_size = {hidden_size}]")
        self.hidden_size, self.gru_hidden_size = hidden_size, gru_hidden_size
        self.num_uncorrected = num_uncorrected
        self.prefix_gru = nn.GRU(hidden_size, gru_hidden_size, num_layers=1, bias=False)
        self.embed_proj = nn.Sequential(
            nn.Linear(hidden_size + gru_hidden_size, emb_dim, bias=False),
            nn.SiLU(),
            nn.Linear(emb_dim, vocab_size, bias=False),
        )
        # The target's input embeddings: shared with the target, not a parameter of ours.
        self.embed_weight = embed_weight.detach()
        self._input_table: torch.Tensor | None = None
        self._table_rows: torch.Tensor | None = None   # target id -> table row (-1: none)

    def _apply(self, fn, recurse=True):
        # `.to()` / `.cuda()` move the shared embeddings and the input table with the weights
        # (plain attributes, not parameters: `nn.Module` alone would leave them behind).
        super()._apply(fn, recurse)
        self.embed_weight = fn(self.embed_weight)
        if self._input_table is not None:
            self._input_table = fn(self._input_table)
        if self._table_rows is not None:   # an index: moved, never cast
            self._table_rows = self._table_rows.to(self._input_table.device)
        return self

    def use_input_table(self, enabled: bool = True, ids: torch.Tensor | None = None) -> None:
        """Fast path: precompute embed @ W_ih^T so a GRU step's input is a gather.

        `ids` (sorted target ids, e.g. a reduced draft vocabulary's) limits the table to those
        rows ([N, 3G] instead of [V, 3G]); a step whose tokens fall outside them (a root
        token, say) computes those rows the usual way. Same products, another summation
        order."""
        self._input_table = self._table_rows = None
        if not enabled:
            return
        if ids is None:
            self._input_table = linear(self.embed_weight, self.w_ih).contiguous()
            return
        ids = ids.to(device=self.embed_weight.device, dtype=torch.long)
        self._input_table = linear(self.embed_weight[ids], self.w_ih).contiguous()
        rows = torch.full((self.embed_weight.shape[0],), -1, dtype=torch.long,
                          device=ids.device)
        rows[ids] = torch.arange(ids.shape[0], device=ids.device)
        self._table_rows = rows

    def _step_inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        """W_ih . embed(tokens), [..., 3G]: from the input table where it holds the token."""
        table = self._input_table
        if table is None:
            return linear(self.embed_weight[tokens], self.w_ih)
        if self._table_rows is None:
            return table[tokens]
        rows = self._table_rows[tokens]
        outside = rows < 0
        gi = table[rows.clamp(min=0)]
        if bool(outside.any()):   # host check: the restricted table is a CPU fast path
            gi[outside] = linear(self.embed_weight[tokens[outside]], self.w_ih)
        return gi

    @property
    def w_ih(self) -> torch.Tensor:
        return self.prefix_gru.weight_ih_l0    # [3G, H]

    @property
    def w_hh(self) -> torch.Tensor:
        return self.prefix_gru.weight_hh_l0    # [3G, G]

    def gru_step(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """state [..., G], tokens [...] -> the next state [..., G]."""
        gi = self._step_inputs(tokens)
        gh = linear(state, self.w_hh)
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, h_n = gh.chunk(3, dim=-1)
        reset = torch.sigmoid(i_r + h_r)
        update = torch.sigmoid(i_z + h_z)
        new = torch.tanh(i_n + reset * h_n)
        return (1 - update) * new + update * state

    # --- the correction-head contract (vllm_dartree.tree.heads.CorrectionHead) ---

    def init(self, root_tokens: torch.Tensor) -> torch.Tensor:
        zero = self.w_hh.new_zeros(root_tokens.shape[0], 1, self.gru_hidden_size)
        return self.gru_step(zero, root_tokens[:, None])

    def prepare(self, hidden: torch.Tensor, candidate_ids: torch.Tensor) -> GRUPrepared:
        z_proj = linear(hidden, self.embed_proj[0].weight[:, :self.hidden_size])
        return GRUPrepared(z_proj=z_proj, cand_w2=self.embed_proj[2].weight[candidate_ids])

    def score(self, prepared: GRUPrepared, depth: int, state: torch.Tensor) -> torch.Tensor:
        w1_state = self.embed_proj[0].weight[:, self.hidden_size:]                 # [E, G]
        mid = nn.functional.silu(prepared.z_proj[:, depth, None, :] + linear(state, w1_state))
        return torch.bmm(mid, prepared.cand_w2[:, depth].transpose(1, 2))          # [R, P, K]

    def advance(self, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.gru_step(state, tokens)

    # --- full-vocabulary form, for training and as a test oracle ---

    def correction(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], state [..., G] -> the full correction W2 . SiLU(W1 [z; s]), [..., V]."""
        return self.embed_proj(torch.cat([hidden.to(state.dtype), state], dim=-1))
