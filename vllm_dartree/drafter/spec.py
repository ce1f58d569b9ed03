"""DrafterSpec: what a drafter checkpoint's config.json says, parsed and validated once.

Three released formats (facts in research/drafters.md):
- `dflash`  z-lab DFlash (`DFlashDraftModel`, no projector): block `[root, MASK x 15]`, slot 0
            dropped, slots 1..15 predict p0+1..p0+15 -> 15 depths, no correction head.
- `domino`  `DominoDraftModel`, or `DFlashDraftModel` with projector_type "domino" / "causal_v5":
            shift_label = true -> all 16 slots predict (slot j predicts p0+j+1), GRU head,
            depth 1 uncorrected (pure_draft_prefix_len = 1).
- `dspark`  `Qwen3DSparkModel` / `DSparkDraftModel`: block of verification_block_size slots,
            depths are the block_size slots from proposal_hidden_offset (sample_from_anchor),
            vanilla Markov head (corrects from depth 1), optional confidence head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DrafterSpec", "TargetInfo", "parse_drafter_config", "build_target_layer_ids"]

_DSPARK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel")


@dataclass(frozen=True, slots=True)
class TargetInfo:
    """What the drafter must agree with in the target model."""
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    format: str                       # "dflash" | "domino" | "dspark"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    target_layer_ids: tuple[int, ...]  # 0-based target layers whose outputs are the context
    mask_token_id: int
    query_len: int                    # slots of the query block [root, MASK ...]
    depth_offset: int                 # slot that predicts depth 1
    num_depths: int                   # draft depths per round
    # correction heads
    gru_hidden_size: int = 0          # domino
    emb_dim: int = 0                  # domino
    num_uncorrected: int = 0          # domino: pure_draft_prefix_len
    markov_rank: int = 0              # dspark
    confidence_in_dim: int = 0        # dspark confidence head input (0 = none)
    # reduced draft vocabulary (config key `draft_vocab_size`; tensor `draft_vocab_ids`
    # [N] int64, strictly increasing target ids): the drafter scores only these N tokens
    draft_vocab_size: int = 0         # 0 = the target's whole vocabulary

    @property
    def output_size(self) -> int:
        """Columns of the drafter's logits (and rows of a GRU head's W2)."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def head_kind(self) -> str:
        if self.format == "dspark":
            return "markov" if self.markov_rank > 0 else "none"
        return {"dflash": "none", "domino": "gru"}[self.format]


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default choice: evenly spaced layers (Qwen3 36 layers, 5 -> [1, 9, 17, 25, 33])."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _need(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise ValueError(f"{where}: missing required key {key!r}")
    return cfg[key]


def detect_format(cfg: dict[str, Any], where: str) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    projector = (cfg.get("dflash_config") or {}).get("projector_type")
    if arch == "DominoDraftModel" or (arch == "DFlashDraftModel" and projector in ("domino",
                                                                                 "causal_v5")):
        return "domino"
    if arch == "DFlashDraftModel":
        if projector is not None:
            raise NotImplementedError(f"{where}: projector_type {projector!r} is not supported "
                                      "(known: none, 'domino', 'causal_v5')")
        return "dflash"
    if arch in _DSPARK_ARCHS:
        return "dspark"
    raise ValueError(f"{where}: architectures = {archs} is not a drafter format we load; "
                     "expected DFlashDraftModel, DominoDraftModel, Qwen3DSparkModel or "
                     "DSparkDraftModel")


def parse_drafter_config(cfg: dict[str, Any], where: str = "config.json") -> DrafterSpec:
    """config.json dict -> DrafterSpec; errors name the file and the key."""
    fmt = detect_format(cfg, where)
    hidden = int(_need(cfg, "hidden_size", where))
    heads = int(_need(cfg, "num_attention_heads", where))
    layers = int(_need(cfg, "num_hidden_layers", where))
    block = int(_need(cfg, "block_size", where))
    if cfg.get("rope_scaling"):
        raise NotImplementedError(f"{where}: rope_scaling = {cfg['rope_scaling']} is not "
                                  "supported by the drafter backbone")
    common = dict(
        hidden_size=hidden,
        intermediate_size=int(_need(cfg, "intermediate_size", where)),
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(cfg.get("rope_theta", 1e6)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        vocab_size=int(_need(cfg, "vocab_size", where)),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or 0),
    )
    if not 0 <= common["draft_vocab_size"] <= common["vocab_size"]:
        raise ValueError(f"{where}: draft_vocab_size = {common['draft_vocab_size']} must be "
                         f"in [1, vocab_size = {common['vocab_size']}] (or absent)")
    if fmt == "dspark":
        if common["draft_vocab_size"]:
            raise NotImplementedError(f"{where}: draft_vocab_size is supported for DFlash and "
                                      "Domino drafters, not DSpark's Markov head")
        return _dspark_spec(cfg, where, block, common)
    dcfg = _need(cfg, "dflash_config", where)
    ids = dcfg.get("target_layer_ids") or build_target_layer_ids(
        int(_need(cfg, "num_target_layers", where)), layers)
    mask = int(_need(dcfg, "mask_token_id", f"{where} dflash_config"))
    if fmt == "dflash":
        return DrafterSpec(format=fmt, target_layer_ids=tuple(ids), mask_token_id=mask,
                           query_len=block, depth_offset=1, num_depths=block - 1, **common)
    shift = bool(dcfg.get("shift_label", False))
    return DrafterSpec(
        format=fmt, target_layer_ids=tuple(ids), mask_token_id=mask, query_len=block,
        depth_offset=0 if shift else 1, num_depths=block if shift else block - 1,
        gru_hidden_size=int(dcfg.get("gru_hidden_dim") or _need(dcfg, "emb_dim", where)),
        emb_dim=int(_need(dcfg, "emb_dim", f"{where} dflash_config")),
        num_uncorrected=int(dcfg.get("pure_draft_prefix_len", 0)), **common)


def _dspark_spec(cfg: dict[str, Any], where: str, block: int, common: dict) -> DrafterSpec:
    head_type = cfg.get("markov_head_type", "vanilla")
    rank = int(cfg.get("markov_rank", 0))
    if rank > 0 and head_type != "vanilla":
        raise NotImplementedError(f"{where}: markov_head_type = {head_type!r}; only 'vanilla' "
                                  "is supported (set markov_rank = 0 to run without the head)")
    mask = cfg.get("mask_token_id", cfg.get("dspark_noise_token_id"))
    if mask is None:
        raise ValueError(f"{where}: missing required key 'mask_token_id' "
                         "(or 'dspark_noise_token_id')")
    query = int(cfg.get("verification_block_size", block))
    offset = int(cfg.get("proposal_hidden_offset", 0))
    if not cfg.get("sample_from_anchor", True):
        offset, block = 1, block - 1
    if offset + block > query:
        raise ValueError(f"{where}: proposal_hidden_offset {offset} + block_size {block} "
                         f"exceeds verification_block_size {query}")
    conf = 0
    if cfg.get("enable_confidence_head", False):
        conf = common["hidden_size"] + (rank if cfg.get("confidence_head_with_markov") else 0)
    return DrafterSpec(format="dspark", target_layer_ids=tuple(_need(cfg, "target_layer_ids",
                                                                        where)),
                       mask_token_id=int(mask), query_len=query, depth_offset=offset,
                       num_depths=block, markov_rank=rank, confidence_in_dim=conf, **common)
