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
