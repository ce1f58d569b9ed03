"""Checkpoint formats: round trips, and every documented error with its message."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_dartree.drafter import CheckpointError, TargetInfo, load_drafter
from vllm_dartree.drafter.checkpoint import _canonical, _expected
from vllm_dartree.testing import write_tiny_drafter

FORMATS = ["dflash", "domino", "domino-legacy", "dspark"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip(fmt, tiny_target, drafter_folders):
    drafter = tiny_target.load(drafter_folders[fmt])
    params = _expected(drafter)
    stored = load_file(str(drafter_folders[fmt] / "model.safetensors"))
    used = 0
    for raw, tensor in stored.items():
        key = _canonical(raw)
        if key in ("embed_tokens.weight", "lm_head.weight"):
            continue   # DSpark ships copies; the target's own are used
        assert torch.equal(params[key].detach(), tensor.float()), raw
        used += 1
    assert used == len(params)
    spec = drafter.spec
    assert (spec.format, spec.num_depths, spec.depth_offset) == {
        "dflash": ("dflash", 15, 1), "domino": ("domino", 16, 0),
        "domino-legacy": ("domino", 16, 0), "dspark": ("dspark", 7, 0)}[fmt]
    assert spec.head_kind == {"dflash": "none", "domino": "gru", "domino-legacy": "gru",
                              "dspark": "markov"}[fmt]
    assert (drafter.confidence_head is not None) == (fmt == "dspark")


def test_sharded_checkpoint_loads_the_same(tmp_path, tiny_target, drafter_folders):
    sharded = write_tiny_drafter(tmp_path / "sharded", "domino", tiny_target.folder, shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    a, b = tiny_target.load(sharded), tiny_target.load(drafter_folders["domino"])
    for (ka, pa), (kb, pb) in zip(_expected(a).items(), _expected(b).items()):
        assert ka == kb and torch.equal(pa, pb)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder, fn):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))
    return path


def test_wrong_shape_names_file_key_and_shapes(tmp_path, tiny_target, drafter_folders):
    folder = _copy(drafter_folders["domino"], tmp_path / "d")
    path = _edit_tensors(folder, lambda t: t.__setitem__(
        "layers.1.self_attn.k_proj.weight", torch.zeros(8, 64, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError) as err:
        tiny_target.load(folder)
    msg = str(err.value)
    assert str(path) in msg and "layers.1.self_attn.k_proj.weight" in msg
    assert "expected shape (32, 64)" in msg and "found (8, 64)" in msg


def test_missing_and_unexpected_tensors(tmp_path, tiny_target, drafter_folders):
    folder = _copy(drafter_folders["domino"], tmp_path / "m")
    _edit_tensors(folder, lambda t: t.pop("prefix_gru.weight_hh_l0"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['prefix_gru.weight_hh_l0'\]"):
        tiny_target.load(folder)
    folder = _copy(drafter_folders["dflash"], tmp_path / "u")
    _edit_tensors(folder, lambda t: t.__setitem__("prefix_gru.weight_ih_l0", torch.zeros(3)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'prefix_gru.weight_ih_l0'"):
        tiny_target.load(folder)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tmp_path, tiny_target, drafter_folders, damage):
    folder = _copy(drafter_folders["dflash"], tmp_path / damage)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\x13\x37not safetensors" * 10 if damage == "garbage" else
                     data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated") as err:
        tiny_target.load(folder)
    assert str(path) in str(err.value)


def _with_config(tmp_path, src, edit):
    folder = _copy(src, tmp_path / "c")
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("edit,error,match", [
    (lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"]), ValueError,
     "not a drafter format"),
    (lambda c: c["dflash_config"].__setitem__("projector_type", "medusa"), NotImplementedError,
     "projector_type 'medusa'"),
    (lambda c: c["dflash_config"].__setitem__("mask_token_id", 5000), CheckpointError,
     "mask_token_id = 5000 is outside"),
    (lambda c: c["dflash_config"].__setitem__("target_layer_ids", [1, 9]), CheckpointError,
     r"layers \[9\] outside the target's 6"),
    (lambda c: c.pop("hidden_size"), ValueError, "missing required key 'hidden_size'"),
    (lambda c: c.__setitem__("rope_scaling", {"type": "yarn"}), NotImplementedError,
     "rope_scaling"),
])
def test_config_errors(tmp_path, tiny_target, drafter_folders, edit, error, match):
    folder = _with_config(tmp_path, drafter_folders["dflash"], edit)
    with pytest.raises(error, match=match) as err:
        tiny_target.load(folder)
    assert "config.json" in str(err.value)


def test_target_mismatch_and_missing_config(tmp_path, tiny_target, drafter_folders):
    other = TargetInfo(hidden_size=128, vocab_size=tiny_target.info.vocab_size,
                       num_hidden_layers=6)
    embed = tiny_target.model.model.embed_tokens.weight
    with pytest.raises(CheckpointError, match="hidden_size = 64 does not match the target's "
                                              "hidden_size = 128"):
        load_drafter(drafter_folders["domino"], other, embed, embed)
    with pytest.raises(CheckpointError, match="no config.json"):
        tiny_target.load(tmp_path)


def test_unsupported_markov_variant(tmp_path, tiny_target, drafter_folders):
    folder = _with_config(tmp_path, drafter_folders["dspark"],
                          lambda c: c.__setitem__("markov_head_type", "gated"))
    with pytest.raises(NotImplementedError, match="markov_head_type = 'gated'"):
        tiny_target.load(folder)


def test_drafter_weights_follow_the_target_device(tiny_target, drafter_folders):
    """The drafter's own weights go where the target's shared embedding lives (on a GPU:
    cuda; here the meta device stands in for "not the CPU")."""
    embed = tiny_target.model.model.embed_tokens.weight.detach().to("meta")
    head = tiny_target.model.lm_head.weight.detach().to("meta")
    drafter = load_drafter(drafter_folders["domino"], tiny_target.info, embed, head,
                           dtype=torch.bfloat16)
    params = list(drafter.backbone.parameters()) + list(drafter.head.parameters())
    assert params and all(p.device.type == "meta" for p in params)
    assert all(p.dtype == torch.bfloat16 for p in params)
