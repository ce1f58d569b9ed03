"""A bounded load test of `vllm serve` with dartree: streams, client aborts, every kind of
request, two identical waves, and the checks a server operator cares about.

    python -m vllm_dartree.bench.load --smollm2                  # SmolLM2 + shipped drafter
    python -m vllm_dartree.bench.load --target DIR --drafter DIR [--requests 200]
        [--concurrency 32] [--max-tokens 32] [--out report.json]

Loopback only; starts its own servers and stops them. First a plain server (no
speculation) answers the greedy requests once, for reference; then the dartree server runs
two identical waves of `--requests` streamed completions, at most `--concurrency` in
flight: greedy, seeded sampling, n = 2, logprobs, stop strings, 1-3 token answers, about
one in five dropped by the client after two chunks, prompts longer than `max_model_len`
and empty prompts (which must get a clean 400 with vLLM's message). Reported, and checked
(exit status 1 if any check fails): the server is alive at the end; no 5xx and no broken
connection; every finished greedy completion equals the plain server's; the worker's
per-request state (`vllm:dartree_live_request_state`) back to 0 after each wave; resident
memory of the server's processes after wave 2 within 5% of after wave 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Request", "make_requests", "main"]

GREEDY_KINDS = ("greedy", "logprobs", "stop", "short")
KINDS = ("greedy", "seeded", "n2", "logprobs", "stop", "short")
DROP_AFTER_CHUNKS = 2
WORDS = ("the river ships sail north before the winter storms while traders count coins in "
         "old harbour towns and write letters about weather prices roads").split()


@dataclass
class Request:
    index: int
    kind: str                  # KINDS, or "too_long" / "empty" (expect 400)
    prompt: str
    body: dict
    drop: bool = False         # the client hangs up after DROP_AFTER_CHUNKS chunks


@dataclass
class Result:
    index: int
    status: int = 0            # HTTP status (0: the connection broke)
    texts: dict = field(default_factory=dict)     # choice index -> text
    finished: bool = False     # read to the end ([DONE])
    error: str = ""


def make_requests(prompts: list[str], count: int, max_tokens: int, max_model_len: int
                  ) -> list[Request]:
    """The deterministic mix of one wave."""
    out = []
    for i in range(count):
        prompt = prompts[i % len(prompts)]
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "temperature": 0.0}
        if i % 23 == 7:
            out.append(Request(i, "empty", "", {**body, "prompt": ""}))
            continue
        if i % 19 == 5:
            long = " ".join(WORDS[j % len(WORDS)] for j in range(4 * max_model_len))
            out.append(Request(i, "too_long", long, {**body, "prompt": long}))
            continue
        kind = KINDS[i % len(KINDS)]
        if kind == "seeded":
            body.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        elif kind == "n2":
            body.update(temperature=0.7, seed=2000 + i, n=2)
        elif kind == "logprobs":
            body.update(logprobs=2)
        elif kind == "stop":
            body.update(stop=[" the", "\n\n"])
        elif kind == "short":
            body.update(max_tokens=1 + i % 3)
        out.append(Request(i, kind, prompt, body, drop=i % 5 == 4))
    return out


async def _one(client, url: str, model: str, req: Request) -> Result:
    res = Result(req.index)
    chunks = 0
    try:
        async with client.stream("POST", url, json={**req.body, "model": model}) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode(errors="replace")[:300]
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data.strip() == "[DONE]":
                    res.finished = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:   # an error inside a 200 stream (the engine died?)
                    err = chunk["error"]
                    res.status = int(err.get("code") or 500)
                    res.error = str(err.get("message", err))[:300]
                    return res
                for choice in chunk.get("choices", ()):
                    i = choice.get("index", 0)
                    res.texts[i] = res.texts.get(i, "") + (choice.get("text") or "")
                chunks += 1
                if req.drop and chunks >= DROP_AFTER_CHUNKS:
                    break      # leaving the block closes the connection: vLLM aborts
    except Exception as err:   # noqa: BLE001 - a broken connection is a finding
        res.status, res.error = 0, f"{type(err).__name__}: {err}"
    return res


async def _wave(port: int, model: str, requests: list[Request], concurrency: int,
                progress: str) -> list[Result]:
    import httpx

    url = f"http://127.0.0.1:{port}/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def run(client, req):
        nonlocal done
        async with sem:
            res = await _one(client, url, model, req)
        done += 1
        print(f"\r{progress}: {done}/{len(requests)} requests", end="", file=sys.stderr,
              flush=True)
        return res

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        out = await asyncio.gather(*(run(client, r) for r in requests))
    print(file=sys.stderr)
    return list(out)


# -- servers ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m vllm_dartree.engine.cli serve` on a loopback port, with its log."""

    def __init__(self, target: str, spec: dict | None, log: Path, max_model_len: int,
                 concurrency: int, extra: list[str] | None = None):
        self.port = _free_port()
        args = [sys.executable, "-m", "vllm_dartree.engine.cli", "serve", target,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--enforce-eager", "--max-model-len", str(max_model_len),
                "--gpu-memory-utilization", "0.2", "--max-num-seqs", str(concurrency),
                "--seed", "0", "--no-enable-prefix-caching", *(extra or [])]
        # prefix caching off for every server: the plugin turns it off for dartree, and a
        # plain or ngram server that kept it would skip the prefill of every prompt it has
        # seen before (benchmarks send the same prompts at each level), not a like-for-like
        # comparison of decoding
        if spec is not None:
            args += ["--speculative-config", json.dumps(spec)]
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        env.pop("TRITON_INTERPRET", None)
        self.log_path = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT)
        self.model = self._wait()

    def _get(self, path: str, timeout: float = 30) -> tuple[int, str]:
        import urllib.error
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                        timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, ""
        except OSError:
            return 0, ""

    def _wait(self, limit: float = 900) -> str:
        deadline = time.time() + limit
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n"
                                   + self.log_path.read_text()[-3000:])
            status, text = self._get("/v1/models", timeout=5)
            if status == 200:
                return json.loads(text)["data"][0]["id"]
            time.sleep(1)
        raise RuntimeError(f"the server did not start in {limit:.0f} s")

    def alive(self) -> bool:
        return self.proc.poll() is None and self._get("/health")[0] == 200

    def metrics(self) -> str:
        return self._get("/metrics")[1]

    def live_state(self) -> dict[str, float]:
        """vllm:dartree_live_request_state by kind (empty if the gauge is missing)."""
        pattern = re.compile(r'^vllm:dartree_live_request_state\{[^}]*kind="([a-z_]+)"[^}]*\}'
                             r'\s+([0-9.eE+-]+)$', re.M)
        return {k: float(v) for k, v in pattern.findall(self.metrics())}

    def rss_bytes(self) -> int:
        """Resident memory of the server and all its descendants (API server, engine)."""
        pids, frontier = {self.proc.pid}, [self.proc.pid]
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
            except (OSError, IndexError, ValueError):
                continue
        while frontier:
            for child in children.get(frontier.pop(), ()):
                if child not in pids:
                    pids.add(child)
                    frontier.append(child)
        total = 0
        for pid in pids:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                continue
        return total

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _PeakSampler:
    """The live-state gauge's largest reading per kind while a wave runs (it must move)."""

    def __init__(self, server: Server, every: float = 0.2):
        self.server, self.every = server, every
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for kind, value in self.server.live_state().items():
                self.peak[kind] = max(self.peak.get(kind, 0.0), value)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _settle(server: Server, limit: float = 60) -> dict[str, float]:
    """The live-state gauge once it reads 0 everywhere (or whatever it reads after limit)."""
    deadline = time.time() + limit
    state = server.live_state()
    while time.time() < deadline and (not state or any(state.values())):
        time.sleep(1)
        state = server.live_state()
    return state


# -- the run ------------------------------------------------------------------------------
def _prompts(args) -> list[str]:
    if args.smollm2 or args.datasets:
        from vllm_dartree.bench.datasets import load_prompts
        names = (args.datasets or "gsm8k,humaneval,mt-bench").split(",")
        return [q.prompt for name in names for q in load_prompts(name, 12)]
    return [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(3 + i % 9))
            for i in range(24)]


def _check_wave(requests, results, reference) -> dict:
    """Counts and failures of one wave against the plain server's greedy answers."""
    out = {"requests": len(results), "status": {}, "dropped": 0, "finished": 0,
           "greedy_checked": 0, "greedy_mismatches": [], "bad_400": [], "server_errors": []}
    for req, res in zip(requests, results):
        out["status"][str(res.status)] = out["status"].get(str(res.status), 0) + 1
        if res.status >= 500 or res.status == 0:
            out["server_errors"].append({"index": req.index, "kind": req.kind,
                                         "status": res.status, "error": res.error})
        if req.kind in ("empty", "too_long"):
            if res.status != 400 or "error" not in res.error.lower():
                out["bad_400"].append({"index": req.index, "kind": req.kind,
                                       "status": res.status, "body": res.error[:200]})
            continue
        out["dropped"] += req.drop
        out["finished"] += res.finished
        if req.kind in GREEDY_KINDS and not req.drop and res.finished:
            out["greedy_checked"] += 1
            if res.texts.get(0, "") != reference.get(req.index):
                out["greedy_mismatches"].append({"index": req.index, "kind": req.kind,
                                                 "got": res.texts.get(0, ""),
                                                 "plain": reference.get(req.index)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.bench.load",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--smollm2", action="store_true",
                        help="target = SmolLM2-135M-Instruct, drafter = the shipped one")
    parser.add_argument("--datasets", help="prompt sets (bench.datasets names)")
    parser.add_argument("--requests", type=int, default=200, help="requests per wave")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--spec", default="{}", help="extra speculative_config keys (JSON)")
    parser.add_argument("--workdir", default="load-run", type=Path, help="server logs")
    parser.add_argument("--out", type=Path, help="write the report here (JSON)")
    args = parser.parse_args(argv)
    if args.smollm2:
        from vllm_dartree.zoo.shipped import smollm2_pair
        args.target, args.drafter = smollm2_pair(args.target, args.drafter)
    if not args.target or not args.drafter:
        parser.error("give --target and --drafter, or --smollm2")
    args.workdir.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(args)
    requests = make_requests(prompts, args.requests, args.max_tokens, args.max_model_len)
    greedy = [r for r in requests if r.kind in GREEDY_KINDS and not r.drop]

    print(f"plain server: {len(greedy)} greedy requests for reference", file=sys.stderr)
    plain = Server(args.target, None, args.workdir / "plain.log", args.max_model_len,
                   args.concurrency)
    try:
        ref = asyncio.run(_wave(plain.port, plain.model, greedy, args.concurrency, "plain"))
    finally:
        plain.stop()
    reference = {r.index: res.texts.get(0, "") for r, res in zip(greedy, ref) if res.finished}

    spec = {"method": "dartree", "model": args.drafter, **json.loads(args.spec)}
    server = Server(args.target, spec, args.workdir / "dartree.log", args.max_model_len,
                    args.concurrency)
    report = {"target": args.target, "drafter": args.drafter, "spec": spec,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "waves": []}
    try:
        for wave in (1, 2):
            start = time.time()
            with _PeakSampler(server) as peak:
                results = asyncio.run(_wave(server.port, server.model, requests,
                                            args.concurrency, f"dartree wave {wave}"))
            checked = _check_wave(requests, results, reference)
            checked["seconds"] = round(time.time() - start, 1)
            checked["live_state_peak"] = peak.peak
            checked["live_state"] = _settle(server)
            checked["rss_bytes"] = server.rss_bytes()
            report["waves"].append(checked)
        report["alive"] = server.alive()
        faults = re.findall(r'^vllm:dartree_drafter_faults\{[^}]*kind="([a-z_]+)"[^}]*\}\s+'
                            r'([0-9.eE+-]+)$', server.metrics(), re.M)
        report["drafter_faults"] = {k: float(v) for k, v in faults}
    finally:
        server.stop()

    w1, w2 = report["waves"]
    growth = w2["rss_bytes"] / max(w1["rss_bytes"], 1) - 1
    checks = {
        "server alive after both waves": report["alive"],
        "no 5xx / broken connections": not (w1["server_errors"] or w2["server_errors"]),
        "empty and too-long prompts get a 400 with vLLM's message":
            not (w1["bad_400"] or w2["bad_400"]),
        "greedy completions identical to the plain server's":
            not (w1["greedy_mismatches"] or w2["greedy_mismatches"]),
        # The adaptive budget may skip the drafter for a whole wave (its contexts then stay
        # pending), so "seen above 0" asks that some per-request gauge moved, not a given one.
        "per-request state back to 0 after each wave (and seen above 0 during it)":
            all(w["live_state"] and not any(w["live_state"].values())
                and any(v > 0 for v in w["live_state_peak"].values()) for w in (w1, w2)),
        "memory growth between waves < 5%": growth < 0.05,
    }
    report["memory_growth"] = growth
    report["checks"] = checks
    for i, w in enumerate((w1, w2), start=1):
        print(f"wave {i}: {w['requests']} requests in {w['seconds']} s, status {w['status']}, "
              f"{w['dropped']} dropped by the client, {w['greedy_checked']} greedy compared "
              f"({len(w['greedy_mismatches'])} differ), live state peak {w['live_state_peak']}, "
              f"after: {w['live_state']}, "
              f"RSS {w['rss_bytes'] / 2**20:.0f} MiB")
    print(f"memory growth wave 1 -> 2: {100 * growth:+.1f}%; drafter faults: "
          f"{report['drafter_faults']}")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
