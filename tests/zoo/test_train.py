"""Drafter training (vllm_dartree.zoo.train): the loss falls on a tiny target's own text,
a run cut off and resumed equals an uninterrupted one, and the exported Domino folder
loads with load_drafter and drafts losslessly in the reference decoder."""

import dataclasses
import json
import math

import pytest
import torch

from vllm_dartree.drafter import TargetInfo, load_drafter, parse_drafter_config
from vllm_dartree.reference import DrafterSession, ReferenceDecoder, SamplingParams
from vllm_dartree.reference.decoder import method_config
from vllm_dartree.testing import write_tiny_drafter, write_tiny_target
from vllm_dartree.zoo.train import (
    DrafterTrainer,
    FeatureShard,
    TrainConfig,
    domino_loss,
    export_domino,
)
from vllm_dartree.tree import build_tree
from vllm_dartree.zoo.draft_vocab import select_draft_vocab

LAYERS = (1, 3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("train")
    target_dir = write_tiny_target(root / "target", seed=4)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    template = write_tiny_drafter(root / "template", "domino", target_dir, layers=1)
    cfg = json.loads((template / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = list(LAYERS)
    cfg["block_size"] = 6
    spec = parse_drafter_config(cfg, "template")
    gen = torch.Generator().manual_seed(0)
    shards = []
    with torch.no_grad():
        for _ in range(10):   # the target's own greedy continuations of random prompts
            prompt = torch.randint(5, 1000, (1, 6), generator=gen)
            ids = target.generate(prompt, max_new_tokens=40, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
            out = target(ids, output_hidden_states=True)
            feats = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)
            shards.append(FeatureShard(ids[0], feats))
    return {"root": root, "target": target, "target_dir": target_dir, "spec": spec,
            "shards": shards}


def _trainer(setup, workdir, mask=False, vocab=None, **kw):
    t = setup["target"]
    config = TrainConfig(**{"steps": 40, "sequences_per_step": 2, "anchors_per_sequence": 8,
                            "lr": 3e-3, "warmup_steps": 5, "checkpoint_every": 10, **kw})
    spec = setup["spec"]
    if vocab is not None:
        spec = dataclasses.replace(spec, draft_vocab_size=vocab.numel())
    return DrafterTrainer(spec, t.model.embed_tokens.weight, t.lm_head.weight,
                          config, workdir, gru_hidden=16, emb_dim=8, learn_mask_embedding=mask,
                          draft_vocab=vocab)


def _vocab(setup, size, leave_out=()):
    """The `size` most frequent tokens of the shards, without `leave_out`."""
    vocab = select_draft_vocab([(s.tokens, 0) for s in setup["shards"]], size + len(leave_out),
                               setup["target"].config.vocab_size)
    return vocab[~torch.isin(vocab, torch.tensor(list(leave_out), dtype=torch.long))][:size]


def test_loss_falls_and_acceptance_rises(setup, tmp_path):
    trainer = _trainer(setup, tmp_path, steps=120)
    before = trainer.evaluate(setup["shards"][:3])
    losses = [trainer.train_step(setup["shards"])["loss"] for _ in range(120)]
    assert sum(losses[-10:]) < 0.6 * sum(losses[:10])
    assert trainer.evaluate(setup["shards"][:3]) > before


def test_held_out_window_reads_only_the_responses_first_tokens(setup, tmp_path):
    """`window` measures acceptance in the first tokens only (where bench.tau drafts): tokens
    beyond the window's last block do not change it, but do change the whole measure."""
    trainer = _trainer(setup, tmp_path, steps=30)
    for _ in range(30):
        trainer.train_step(setup["shards"])
    shards = [dataclasses.replace(s, first_anchor=4) for s in setup["shards"][:4]]
    window, block = 12, trainer.backbone.spec.query_len
    assert trainer.evaluate(shards, window=10_000) == trainer.evaluate(shards)
    gen = torch.Generator().manual_seed(1)
    changed = []
    for s in shards:
        tokens = s.tokens.clone()
        tail = slice(s.first_anchor + window + block, None)
        tokens[tail] = torch.randint(5, 1000, tokens[tail].shape, generator=gen)
        changed.append(dataclasses.replace(s, tokens=tokens))
    assert trainer.evaluate(changed, window=window) == trainer.evaluate(shards, window=window)
    assert trainer.evaluate(changed) != trainer.evaluate(shards)


def test_resume_equals_uninterrupted(setup, tmp_path):
    straight = _trainer(setup, tmp_path / "a", steps=20)
    for _ in range(20):
        straight.train_step(setup["shards"])
    cut = _trainer(setup, tmp_path / "b", steps=20)
    for _ in range(10):
        cut.train_step(setup["shards"])
    resumed = _trainer(setup, tmp_path / "b", steps=20)   # a new process would do this
    assert resumed.step == 10
    for _ in range(10):
        resumed.train_step(setup["shards"])
    for (name, a), (_, b) in zip(straight.backbone.state_dict().items(),
                                 resumed.backbone.state_dict().items()):
        assert torch.equal(a, b), name
    assert [h["loss"] for h in straight.history] == [h["loss"] for h in resumed.history]


def test_loss_uses_every_depth_with_decay(setup, tmp_path):
    trainer = _trainer(setup, tmp_path)
    shard = setup["shards"][0]
    loss, stats = domino_loss(trainer.backbone, trainer.head, shard, torch.tensor([0, 30, 45]),
                              gamma=7.0, lam=0.5)
    # anchors 0 and 30 see all 6 labels; anchor 45 is the last token (T = 46): none
    assert stats["tokens"] == 6 + 6 + 0 and torch.isfinite(loss)


def test_anchors_are_response_tokens(setup, tmp_path):
    trainer = _trainer(setup, tmp_path)
    base = setup["shards"][0]
    shard = FeatureShard(base.tokens, base.features, first_anchor=30)   # T = 46
    assert shard.anchor_range() == (30, 45)
    for _ in range(20):
        a = trainer._anchors(shard)
        assert a.shape == (8,) and int(a.min()) >= 30 and int(a.max()) < 45
        assert torch.equal(a, a.unique())
    short = FeatureShard(base.tokens, base.features, first_anchor=60)   # no response: the end
    assert short.anchor_range() == (44, 45)


def _loss_oracle(backbone, head, shard, anchors, gamma, lam):
    """The loss written one anchor and one depth at a time, straight from the recipe."""
    hidden = backbone.anchored_forward(shard.features, shard.tokens, anchors)
    lm_head, length = backbone.lm_head_weight, shard.tokens.shape[0]
    vocab = backbone.draft_vocab    # a reduced draft vocabulary: CE over its columns only
    total = weight_sum = 0.0
    for a_i, a in enumerate(anchors.tolist()):
        state = head.init(shard.tokens[a:a + 1])[:, 0]            # after the root x_a
        for k in range(1, backbone.spec.num_depths + 1):
            if a + k >= length:
                break
            label = shard.tokens[a + k]
            z = hidden[a_i, k - 1]
            base = lm_head @ z if vocab is None else lm_head[vocab] @ z
            final = base if k <= head.num_uncorrected else base + head.correction(z, state[0])
            column = label if vocab is None else (vocab == label).nonzero().flatten()
            state = head.gru_step(state, label[None])
            if column.numel() == 0:       # outside the draft vocabulary: never proposed
                continue
            ce = lambda logits: -torch.log_softmax(logits, -1)[column].sum()   # noqa: E731
            w = math.exp(-(k - 1) / gamma)
            total = total + w * ((1 - lam) * ce(final) + lam * ce(base))
            weight_sum += w
    return total / weight_sum


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_loss_equals_per_depth_oracle(setup, tmp_path, draft_vocab):
    vocab = None if draft_vocab is None else _vocab(setup, draft_vocab)
    trainer = _trainer(setup, tmp_path, mask=True, vocab=vocab)
    with torch.no_grad():           # a head whose corrections matter (init std 0.02 is tiny)
        for p in trainer.head.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    shard, anchors = setup["shards"][1], torch.tensor([0, 7, 20, 43])
    loss, _ = domino_loss(trainer.backbone, trainer.head, shard, anchors, gamma=7.0, lam=0.3)
    expected = _loss_oracle(trainer.backbone, trainer.head, shard, anchors, 7.0, 0.3)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(loss, [trainer.head.prefix_gru.weight_hh_l0,
                                       trainer.backbone.fc.weight])
    want = torch.autograd.grad(expected, [trainer.head.prefix_gru.weight_hh_l0,
                                          trainer.backbone.fc.weight])
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_bf16_training_learns(setup, tmp_path):
    trainer = _trainer(setup, tmp_path, bf16=True)
    first = trainer.train_step(setup["shards"])["loss"]
    for _ in range(39):
        trainer.train_step(setup["shards"])
    assert all(p.dtype == torch.float32 for p in trainer.backbone.parameters())   # fp32 master
    assert sum(h["loss"] for h in trainer.history[-5:]) / 5 < 0.7 * first


def test_export_loads_and_decodes_losslessly(setup, tmp_path):
    trainer = _trainer(setup, tmp_path, mask=True, steps=10)   # a learned MASK input
    for _ in range(10):
        trainer.train_step(setup["shards"])
    t = setup["target"]
    folder = export_domino(trainer, tmp_path / "drafter", t.config.num_hidden_layers)
    drafter = load_drafter(folder, TargetInfo(t.config.hidden_size, t.config.vocab_size,
                                              t.config.num_hidden_layers),
                           t.model.embed_tokens.weight, t.lm_head.weight, dtype=torch.float32)
    assert drafter.spec.num_depths == 6 and drafter.head is not None
    torch.testing.assert_close(drafter.backbone.mask_embedding.detach(),
                               trainer.backbone.mask_embedding.detach().to(torch.bfloat16).float())
    prompt = setup["shards"][0].tokens[:6].tolist()
    params = SamplingParams(max_new_tokens=20)
    plain = ReferenceDecoder(t).generate(prompt, params).output_tokens
    tree = ReferenceDecoder(t, DrafterSession(drafter),
                            method_config("dartree-pruned", budget=16, width=4, topk=8))
    assert tree.generate(prompt, params).output_tokens == plain


def test_draft_vocab_export_is_lossless_where_the_target_leaves_it(setup, tmp_path):
    """The target's continuation uses tokens outside the draft vocabulary: the drafter
    never proposes them, and the output is still the target's own."""
    t = setup["target"]
    prompt = setup["shards"][0].tokens[:6].tolist()
    params = SamplingParams(max_new_tokens=24)
    plain = ReferenceDecoder(t).generate(prompt, params).output_tokens
    vocab = _vocab(setup, 48, leave_out=plain[3:9])
    assert not set(plain[3:9]) & set(vocab.tolist())
    trainer = _trainer(setup, tmp_path, mask=True, steps=30, vocab=vocab)
    for _ in range(30):
        trainer.train_step(setup["shards"])
    folder = export_domino(trainer, tmp_path / "drafter", t.config.num_hidden_layers)
    drafter = load_drafter(folder, TargetInfo(t.config.hidden_size, t.config.vocab_size,
                                              t.config.num_hidden_layers),
                           t.model.embed_tokens.weight, t.lm_head.weight, dtype=torch.float32)
    assert torch.equal(drafter.vocab_ids, vocab)
    for method in ("dartree-pruned", "ddtree", "domino"):
        session = DrafterSession(drafter)
        config = method_config(method, budget=16, width=4, topk=8)
        result = ReferenceDecoder(t, session, config).generate(prompt, params)
        assert result.output_tokens == plain, method
        drafted = session.draft(plain[-1])      # one more round: only draft-vocabulary tokens
        assert drafted.base_logits.shape[-1] == 48
        tree = build_tree(config, drafted.base_logits, drafted.hidden,
                          torch.tensor([plain[-1]]), drafter.head, drafted.vocab_ids)
        assert bool(torch.isin(tree.tokens[0, :int(tree.num_nodes[0])], vocab).all())

    # a new run warm-started from the export holds its weights (a checkpoint may be gone)
    fresh = _trainer(setup, tmp_path / "warm", mask=True, vocab=vocab)
    fresh.warm_start(folder)
    for (name, a), (_, b) in zip(fresh.head.named_parameters(), trainer.head.named_parameters()):
        torch.testing.assert_close(a, b.detach().to(torch.bfloat16).float(), msg=name)
    with pytest.raises(ValueError, match="another draft vocabulary"):
        _trainer(setup, tmp_path / "warm2", mask=True).warm_start(folder)
    # resuming the run with another draft vocabulary is refused
    with pytest.raises(ValueError, match="another draft vocabulary"):
        _trainer(setup, trainer.workdir, mask=True, vocab=vocab[:-1])


def test_draft_layers_start_from_target_layers(setup, tmp_path):
    t = setup["target"]
    layer = t.model.layers[2]
    trainer = DrafterTrainer(setup["spec"], t.model.embed_tokens.weight, t.lm_head.weight,
                             TrainConfig(steps=1), tmp_path, gru_hidden=16, emb_dim=8,
                             init_layers=[layer.state_dict()])
    ours = trainer.backbone.layers[0].state_dict()
    for name, value in layer.state_dict().items():
        assert torch.equal(ours[name], value), name


def test_experiments_run_resume_and_tabulate(setup, tmp_path, capsys):
    from vllm_dartree.zoo.experiments import main as experiments
    data = tmp_path / "data"
    data.mkdir()
    torch.save([{"tokens": s.tokens, "features": s.features.to(torch.bfloat16), "prompt_len": 6}
                for s in setup["shards"]], data / "features-00000.pt")
    argv = ["--target", str(setup["target_dir"]), "--data", str(data), "--workdir",
            str(tmp_path / "runs"), "--layers", ",".join(map(str, LAYERS)), "--steps", "3",
            "--held-out", "2", "--only", "baseline,lr-constant"]
    experiments(argv)
    out = capsys.readouterr().out
    assert "| the recipe (N = 8192, 1 random layer) |" in out
    assert "| constant learning rate (no cosine decay) |" in out
    results = json.loads((tmp_path / "runs" / "results.json").read_text())
    assert set(results) == {"baseline@3", "lr-constant@3"}
    experiments(argv)                                       # finished runs are not redone
    assert "[1/2]" not in capsys.readouterr().out


def test_cli_trains_exports_and_measures_a_second_held_out_set(setup, tmp_path, capsys):
    """`zoo.train` end to end on zoo.data-shaped shards: it trains, exports, and reports the
    --eval-data set's acceptance (in its first 48 tokens) as held_out_acceptance computes it,
    both while training and with --evaluate."""
    from vllm_dartree.zoo.features import load_shards
    from vllm_dartree.zoo.train import EARLY_WINDOW, held_out_acceptance, main

    def write(folder, shards):
        folder.mkdir()
        torch.save([{"tokens": s.tokens, "features": s.features.to(torch.bfloat16),
                     "prompt_len": 6} for s in shards], folder / "features-00000.pt")
        return folder

    data = write(tmp_path / "data", setup["shards"][:7])
    extra = write(tmp_path / "extra", setup["shards"][7:])
    common = ["--target", str(setup["target_dir"]), "--data", str(data), "--layers",
              ",".join(map(str, LAYERS)), "--block-size", "6", "--gru-hidden", "32",
              "--emb-dim", "16", "--draft-vocab", "0", "--held-out", "2", "--precision", "fp32",
              "--eval-data", str(extra)]
    main(common + ["--workdir", str(tmp_path / "run"), "--steps", "10", "--log-every", "1",
                   "--export", str(tmp_path / "drafter")])
    trained = capsys.readouterr().out
    assert "step 10: held-out accepted" in trained and "; --eval-data " in trained
    main(common + ["--evaluate", str(tmp_path / "drafter")])
    line = [x for x in capsys.readouterr().out.splitlines() if str(extra) in x]
    t = setup["target"]
    drafter = load_drafter(tmp_path / "drafter",
                           TargetInfo(t.config.hidden_size, t.config.vocab_size,
                                      t.config.num_hidden_layers),
                           t.get_input_embeddings().weight.detach(),
                           t.get_output_embeddings().weight.detach(), dtype=torch.float32)
    want = held_out_acceptance(drafter.backbone, drafter.head,
                               load_shards([extra / "features-00000.pt"]), EARLY_WINDOW)
    assert len(line) == 1 and f"accepted {want:.3f} (3 sequences" in line[0]
    # zoo.data --bench-prompts: read as evaluation data, refused as training data
    bench = tmp_path / "bench"
    bench.mkdir()
    (extra / "features-00000.pt").rename(bench / "bench-features-00000.pt")
    main(common[:-1] + [str(bench), "--evaluate", str(tmp_path / "drafter")])
    assert f"{bench} accepted {want:.3f} (3 sequences" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(common[:3] + [str(bench)] + common[4:] + ["--workdir", str(tmp_path / "run2"),
                                                     "--steps", "1"])
    assert "never for training" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):   # a folder without shards is an error, not silence
        main(common[:-1] + [str(tmp_path / "empty"), "--evaluate", str(tmp_path / "drafter")])


def test_warm_start_grows_draft_layers_without_changing_the_drafts(setup, tmp_path):
    """A one-layer export warm-starts a two-layer run: the added layer starts with zero output
    projections, so the grown drafter drafts exactly what the export did; training then moves
    the new layer."""
    t = setup["target"]
    info = TargetInfo(t.config.hidden_size, t.config.vocab_size, t.config.num_hidden_layers)
    small = _trainer(setup, tmp_path / "one", mask=True, steps=5)
    for _ in range(5):
        small.train_step(setup["shards"])
    one = export_domino(small, tmp_path / "one-layer", t.config.num_hidden_layers,
                        dtype=torch.float32)
    config = TrainConfig(steps=5, sequences_per_step=2, anchors_per_sequence=8, lr=3e-3,
                         warmup_steps=1)
    grown = DrafterTrainer(dataclasses.replace(setup["spec"], num_layers=2),
                           t.model.embed_tokens.weight, t.lm_head.weight, config,
                           tmp_path / "two", gru_hidden=16, emb_dim=8, learn_mask_embedding=True)
    grown.warm_start(one)
    new = grown.backbone.layers[1]
    assert not new.self_attn.o_proj.weight.any() and not new.mlp.down_proj.weight.any()
    torch.testing.assert_close(new.self_attn.q_proj.weight,
                               grown.backbone.layers[0].self_attn.q_proj.weight)
    two = export_domino(grown, tmp_path / "two-layer", t.config.num_hidden_layers,
                        dtype=torch.float32)
    shard = setup["shards"][1]
    drafts = []
    for folder, layers in ((one, 1), (two, 2)):
        drafter = load_drafter(folder, info, t.model.embed_tokens.weight, t.lm_head.weight,
                               dtype=torch.float32)
        assert drafter.spec.num_layers == layers
        session = DrafterSession(drafter)
        session.extend(shard.tokens[:12].tolist(), shard.features[:12].float())
        drafts.append(session.draft(int(shard.tokens[12])))
    torch.testing.assert_close(drafts[1].base_logits, drafts[0].base_logits)
    torch.testing.assert_close(drafts[1].hidden, drafts[0].hidden)
    for _ in range(3):
        grown.train_step(setup["shards"])
    assert new.self_attn.o_proj.weight.abs().sum() > 0 and new.mlp.down_proj.weight.abs().sum() > 0
