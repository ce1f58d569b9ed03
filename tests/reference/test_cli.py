"""`python -m vllm_dartree.reference` end to end on tiny models."""

import json

from vllm_dartree.reference.__main__ import main
from vllm_dartree.testing import write_tiny_drafter, write_tiny_target


def test_cli_runs_methods_and_saves_outputs(tmp_path, capsys):
    target = write_tiny_target(tmp_path / "target", seed=2)
    drafter = write_tiny_drafter(tmp_path / "drafter", "domino", target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in
                                 enumerate(["def add(a, b):", "import os", "class Foo:"])))
    out = tmp_path / "out.jsonl"
    main(["--target", str(target), "--drafter", str(drafter), "--method", "ar,dartree-pruned",
          "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "8", "--budget", "16",
          "--save-outputs", str(out)])
    printed = capsys.readouterr().out
    assert "method            dartree-pruned" in printed and "tau" in printed
    assert "speedup over ar  dartree-pruned" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and {r["method"] for r in rows} == {"ar", "dartree-pruned"}
    by = {(r["method"], r["index"]): r["output_tokens"] for r in rows}
    assert by[("ar", 0)] == by[("dartree-pruned", 0)] and by[("ar", 1)] == by[("dartree-pruned", 1)]


def test_cli_refuses_tree_methods_without_a_drafter(tmp_path):
    import pytest
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    with pytest.raises(SystemExit, match="--drafter is required"):
        main(["--target", str(tmp_path), "--method", "ddtree", "--prompts", str(prompts)])


def test_tree_picture_cli_draws_a_verified_round(tmp_path):
    """`python -m vllm_dartree.reference.picture` on tiny models: an SVG with DARTree's and
    DDTree's trees, and each tree's accepted tokens are the target's greedy continuation."""
    import xml.etree.ElementTree as ET

    import torch
    from transformers import AutoModelForCausalLM

    from vllm_dartree.reference.decoder import load_drafter_for, method_config
    from vllm_dartree.reference.picture import draft_round
    from vllm_dartree.reference.picture import main as picture

    target_dir = write_tiny_target(tmp_path / "target", seed=2)
    drafter_dir = write_tiny_drafter(tmp_path / "drafter", "domino", target_dir)
    out = tmp_path / "tree.svg"
    picture(["--target", str(target_dir), "--drafter", str(drafter_dir), "--prompt",
             "def add(a, b):", "--no-chat-template", "--budget", "12", "--after", "3",
             "--out", str(out)])
    root = ET.fromstring(out.read_text())
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")
              if t.get("class") == "title"]
    assert [t.split(":")[0] for t in titles] == ["DARTree", "DDTree"]

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = load_drafter_for(target, drafter_dir, torch.float32)
    configs = {"dartree": method_config("dartree-pruned", budget=12),
               "chain": method_config("domino", budget=12)}
    ids, root_token, results = draft_round(target, drafter, [3, 17, 42, 8], configs, after=2)
    for tree, accepted, num in results.values():
        seq = ids + [root_token]
        greedy = []
        with torch.no_grad():
            for _ in range(num + 1):
                nxt = int(target(torch.tensor([seq])).logits[0, -1].argmax())
                greedy.append(nxt)
                seq.append(nxt)
        assert tree.tokens[0, accepted].tolist() == greedy[:num]
        depths = tree.depths[0, accepted].tolist()
        assert depths == list(range(1, num + 1))
        if num < int(tree.depths.max()):   # the next greedy token is not among the children
            kids = [i for i in range(int(tree.num_nodes[0]))
                    if int(tree.parents[0, i]) == (accepted[-1] if accepted else -1)]
            assert greedy[num] not in tree.tokens[0, kids].tolist()
