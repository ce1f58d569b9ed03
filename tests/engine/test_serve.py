"""`vllm serve ... --speculative-config '{"method": "dartree", ...}'` as users run it: an
OpenAI-compatible server on a loopback port, answering chat and completions, streamed or
not, exactly as the server without speculation; bad configs fail at start-up, non-zero."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine.conftest import dartree_spec
from vllm_dartree.testing import write_tiny_drafter, write_tiny_target

# vLLM's own CLI (`vllm serve`); see vllm_dartree.engine.cli for why not the `vllm` script.
VLLM = [sys.executable, "-m", "vllm_dartree.engine.cli"]
MESSAGES = [[{"role": "user", "content": "Tell me about the sea and the ships."}],
            [{"role": "user", "content": "What is a list?"}]]
PROMPTS = ["The module defines a class that", "def parse(self, text):", "Return the"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("TRITON_INTERPRET", None)
    return env


def _serve_args(target, port, spec=None):
    args = [*VLLM, "serve", str(target), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
            "--gpu-memory-utilization", "0.2", "--max-num-seqs", "4"]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    return args


def _query_server(target, spec, log_path):
    """Start a server, ask it everything, stop it; returns the answers."""
    import openai

    port = _free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_serve_args(target, port, spec), env=_env(), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, f"server exited:\n{Path(log_path).read_text()[-4000:]}"
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.time() < deadline, "server did not start in 600 s"
                time.sleep(1)
        kw = dict(model=model, max_tokens=24, temperature=0.0)
        out = {"completions": [client.completions.create(prompt=p, **kw).choices[0].text
                               for p in PROMPTS],
               "chat": [client.chat.completions.create(messages=m, **kw)
                        .choices[0].message.content for m in MESSAGES]}
        out["completions_stream"] = [
            "".join(c.choices[0].text for c in client.completions.create(prompt=p, stream=True,
                                                                         **kw))
            for p in PROMPTS]
        out["chat_stream"] = [
            "".join(c.choices[0].delta.content or "" for c in
                    client.chat.completions.create(messages=m, stream=True, **kw)
                    if c.choices)
            for m in MESSAGES]
        import urllib.request
        out["metrics"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                                timeout=30).read().decode()
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_matches_plain_server(tiny, tmp_path):
    plain = _query_server(tiny["target"], None, tmp_path / "plain.log")
    ours = _query_server(tiny["target"], dartree_spec(tiny["drafter"]), tmp_path / "dt.log")
    for key in ("completions", "chat", "completions_stream", "chat_stream"):
        assert ours[key] == plain[key], key
    assert ours["completions_stream"] == ours["completions"]
    assert any(ours["completions"]), "the server answered nothing"
    assert "vllm:spec_decode_num_drafts" in ours["metrics"]
    assert "vllm:dartree_tree_nodes_total" in ours["metrics"]
    assert "dartree" in Path(tmp_path / "dt.log").read_text()


@pytest.fixture(scope="module")
def misfit_drafter(tmp_path_factory):
    root = tmp_path_factory.mktemp("misfit")
    other = write_tiny_target(root / "other", hidden=96, head_dim=32, seed=2)
    return write_tiny_drafter(root / "drafter", "domino", other)


@pytest.mark.parametrize("case", ["invalid", "misfit"])
def test_bad_config_fails_at_startup(tiny, misfit_drafter, tmp_path, case):
    """Through `vllm serve`: a bad key (refused when the config is translated) and a drafter
    that does not fit the target (refused once the target is known); every other refusal
    runs the same two paths and is tested in-process (test_units.py)."""
    spec, expected = {
        "invalid": (dartree_spec(tiny["drafter"], depth_bonus=0.5), "depth_bonus"),
        "misfit": (dartree_spec(misfit_drafter), "hidden_size = 96"),
    }[case]
    proc = subprocess.run(_serve_args(tiny["target"], _free_port(), spec), env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert expected in proc.stderr + proc.stdout
