"""`python -m vllm_dartree.bench.serve`: its `vllm bench serve` command line is one vLLM's own
parser accepts with the intended meaning, and its table divides by plain's throughput at
the same concurrency."""

from pathlib import Path

import pytest

from vllm_dartree.bench.serve import bench_command, spec_for, table


def test_bench_command_parses_with_vllms_own_parser(tmp_path):
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    cmd = bench_command(8123, "m", "/tok", tmp_path / "p.jsonl", 18, 4, 64, tmp_path, "x.json")
    assert cmd[1:6] == ["-m", "vllm_dartree.engine.cli", "bench", "serve", "--backend"]
    args = parser.parse_args(cmd[5:])
    assert (args.dataset_name, args.num_prompts, args.max_concurrency) == ("custom", 18, 4)
    assert (args.custom_output_len, args.temperature, args.request_rate) == (64, 0.0, float("inf"))
    assert args.base_url == "http://127.0.0.1:8123" and args.save_result
    assert Path(args.dataset_path) == tmp_path / "p.jsonl" and args.disable_shuffle


def test_specs():
    assert spec_for("plain", "d") is None
    assert spec_for("ngram", "d")["method"] == "ngram"
    assert spec_for("dartree", "d") == {"method": "dartree", "model": "d"}
    assert spec_for("dartree-fixed", "d")["adaptive"] is False
    with pytest.raises(ValueError, match="unknown method"):
        spec_for("eagle", "d")


def test_table_ratios_are_per_concurrency():
    r = lambda tps, tau=None: {"request_throughput": 1.0, "output_throughput": tps,  # noqa: E731
                               "spec_decode_acceptance_length": tau}
    results = {("plain", 1): r(10.0), ("dartree", 1): r(12.5, 2.4),
               ("plain", 4): r(40.0), ("dartree", 4): r(30.0, 2.0)}
    lines = table(results, ["plain", "dartree"], [1, 4]).splitlines()
    assert lines[2].startswith("| plain | 1 |") and lines[2].endswith("| - | 1.00x |")
    assert lines[3].endswith("| 2.40 | 1.25x |")
    assert lines[5].endswith("| 2.00 | 0.75x |")
