"""Load a drafter from a local folder (config.json + one or several safetensors shards).

Detects the format (DFlash, Domino, DSpark), maps the released weight names onto our
modules, and validates everything against the target before a single tensor is used:
every missing, unexpected or misshaped tensor raises `CheckpointError` naming the file, the
key, the expected and the found shape. Corrupt or truncated safetensors files are reported
as such.

A drafter with a reduced draft vocabulary (ours; EAGLE-3 and FR-Spec have the idea) has
`"draft_vocab_size": N` in config.json and the tensor `draft_vocab_ids`, shape [N], int64,
the strictly increasing target ids its logit columns score; its GRU head's W2 is [N, E].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from vllm_dartree.drafter.backbone import DFlashBackbone
from vllm_dartree.drafter.gru_head import DominoGRUHead
from vllm_dartree.drafter.markov_head import MarkovHead
from vllm_dartree.drafter.spec import DrafterSpec, TargetInfo, parse_drafter_config

__all__ = ["CheckpointError", "Drafter", "DRAFT_VOCAB_KEY", "check_drafter_folder",
           "load_drafter", "read_safetensors"]

# Released-name aliases (research/drafters.md): old prefixes -> ours.
_ALIASES = (("midlayer.", "layers.0."), ("encoder.fc.", "fc."), ("logit_head.", ""))
# Tensors some exports carry that we take from the target instead.
_SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


class CheckpointError(ValueError):
    """A drafter checkpoint that does not match its config or the target."""


DRAFT_VOCAB_KEY = "draft_vocab_ids"


@dataclass
class Drafter:
    spec: DrafterSpec
    backbone: DFlashBackbone
    head: DominoGRUHead | MarkovHead | None      # None: uncorrected marginals (DFlash)
    confidence_head: nn.Linear | None = None     # DSpark's acceptance predictor (unused here)

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """[N] target ids of the logits' columns (a reduced draft vocabulary), or None."""
        return self.backbone.draft_vocab


def _modules(spec: DrafterSpec, embed: torch.Tensor, lm_head: torch.Tensor) -> Drafter:
    backbone = DFlashBackbone(spec, embed, lm_head)
    head: DominoGRUHead | MarkovHead | None = None
    if spec.head_kind == "gru":
        head = DominoGRUHead(spec.hidden_size, spec.gru_hidden_size, spec.emb_dim,
                             spec.output_size, embed, num_uncorrected=spec.num_uncorrected)
    elif spec.head_kind == "markov":
        head = MarkovHead(spec.vocab_size, spec.markov_rank)
    conf = nn.Linear(spec.confidence_in_dim, 1) if spec.confidence_in_dim else None
    return Drafter(spec, backbone, head, conf)


def _expected(drafter: Drafter) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the parameter it fills."""
    out = {k: p for k, p in drafter.backbone.named_parameters()}
    if isinstance(drafter.head, DominoGRUHead):
        out.update(drafter.head.named_parameters())
    elif isinstance(drafter.head, MarkovHead):
        out.update({f"markov_head.{k}": p for k, p in drafter.head.named_parameters()})
    if drafter.confidence_head is not None:
        out.update({f"confidence_head.proj.{k}": p
                    for k, p in drafter.confidence_head.named_parameters()})
    return out


def _canonical(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    for old, new in _ALIASES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({folder / f for f in weight_map.values()})
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder}: no *.safetensors file found")
    return shards


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one file; a corrupt or truncated file raises CheckpointError."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard listed by the index does not exist") from None
    except (SafetensorError, OSError, RuntimeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err}); it is corrupt "
                              "or truncated, download it again") from err


def _check_target(spec: DrafterSpec, target: TargetInfo, where: str) -> None:
    checks = [
        ("hidden_size", spec.hidden_size, target.hidden_size),
        ("vocab_size", spec.vocab_size, target.vocab_size),
    ]
    for key, ours, theirs in checks:
        if ours != theirs:
            raise CheckpointError(f"{where}: {key} = {ours} does not match the target's "
                                  f"{key} = {theirs}")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise CheckpointError(f"{where}: target_layer_ids {list(spec.target_layer_ids)} name "
                              f"layers {bad} outside the target's {target.num_hidden_layers}")
    if not 0 <= spec.mask_token_id < target.vocab_size:
        raise CheckpointError(f"{where}: mask_token_id = {spec.mask_token_id} is outside the "
                              f"vocabulary [0, {target.vocab_size})")
    if spec.num_heads % spec.num_kv_heads:
        raise CheckpointError(f"{where}: num_attention_heads = {spec.num_heads} must be a "
                              f"multiple of num_key_value_heads = {spec.num_kv_heads}")


def check_drafter_folder(folder: str | Path, target: TargetInfo) -> DrafterSpec:
    """The folder's DrafterSpec, checked against the target (config only, no tensor read)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder}: no config.json (is this a drafter folder?)")
    spec = parse_drafter_config(json.loads(config_path.read_text()), str(config_path))
    _check_target(spec, target, str(config_path))
    _shards(folder)
    return spec


def load_drafter(folder: str | Path, target: TargetInfo, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, dtype: torch.dtype | None = None,
                 head_dtype: torch.dtype | None = None) -> Drafter:
    """Build and fill a drafter from `folder`; embed/lm_head weights are the target's, and
    the drafter's own weights go to their device (in `dtype`, default theirs; the
    correction head in `head_dtype`, default `dtype`)."""
    folder = Path(folder)
    spec = check_drafter_folder(folder, target)
    for name, w, shape in (("embed_tokens", embed_weight, (target.vocab_size, target.hidden_size)),
                           ("lm_head", lm_head_weight, (target.vocab_size, target.hidden_size))):
        if tuple(w.shape) != shape:
            raise CheckpointError(f"target {name}: expected shape {shape}, found {tuple(w.shape)}")
    drafter = _modules(spec, embed_weight, lm_head_weight)
    expected = _expected(drafter)
    filled: set[str] = set()
    items = [(shard, raw, tensor) for shard in _shards(folder)
             for raw, tensor in read_safetensors(shard).items()]
    vocab_ids = None
    for shard, raw, tensor in items:   # the draft vocabulary first: it sizes the head's W2
        if _canonical(raw) == DRAFT_VOCAB_KEY:
            if not spec.draft_vocab_size:
                raise CheckpointError(f"{shard}: holds {DRAFT_VOCAB_KEY!r} but config.json "
                                      "has no draft_vocab_size")
            vocab_ids = _check_draft_vocab(tensor, spec, f"{shard}: tensor {raw!r}")
    if spec.draft_vocab_size and vocab_ids is None:
        raise CheckpointError(f"{folder}: config.json sets draft_vocab_size = "
                              f"{spec.draft_vocab_size} but no shard holds {DRAFT_VOCAB_KEY!r}")
    for shard, raw, tensor in items:
        key = _canonical(raw)
        if key in _SHARED_WITH_TARGET or key == DRAFT_VOCAB_KEY:
            continue
        if key == "mask_embedding":
            drafter.backbone.mask_embedding = nn.Parameter(tensor.reshape(-1).float())
            continue
        if key not in expected:
            raise CheckpointError(f"{shard}: unexpected tensor {raw!r} for a {spec.format} "
                                  f"drafter with this config")
        want = tuple(expected[key].shape)
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{shard}: tensor {raw!r}: expected shape {want}, "
                                  f"found {tuple(tensor.shape)}")
        with torch.no_grad():
            expected[key].copy_(tensor)
        filled.add(key)
    missing = sorted(set(expected) - filled)
    if missing:
        raise CheckpointError(f"{folder}: missing tensors {missing[:6]}"
                              f"{' ...' if len(missing) > 6 else ''} for a {spec.format} drafter")
    dtype = dtype or embed_weight.dtype
    for module, to in ((drafter.backbone, dtype), (drafter.head, head_dtype or dtype),
                       (drafter.confidence_head, dtype)):
        if module is not None:   # on the target's device (its shared weights live there)
            module.to(device=embed_weight.device, dtype=to).eval()
    drafter.backbone.set_draft_vocab(vocab_ids)
    return drafter


def _check_draft_vocab(ids: torch.Tensor, spec: DrafterSpec, where: str) -> torch.Tensor:
    """The draft vocabulary's target ids, validated: [N] integers, strictly increasing,
    inside the target's vocabulary."""
    n = spec.draft_vocab_size
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or tuple(ids.shape) != (n,):
        raise CheckpointError(f"{where}: expected int64 [{n}] (draft_vocab_size), found "
                              f"{ids.dtype} {list(ids.shape)}")
    ids = ids.long()
    if n and not (0 <= int(ids[0]) and int(ids[-1]) < spec.vocab_size):
        raise CheckpointError(f"{where}: target ids must lie in [0, {spec.vocab_size})")
    if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise CheckpointError(f"{where}: target ids must be strictly increasing (sorted, "
                              "no repeats)")
    return ids
