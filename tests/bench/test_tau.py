"""The tau table (vllm_dartree.bench.tau): every row on a tiny target, the table's arithmetic,
the lossless check, and a resumed run that reuses finished cells."""

import json

import pytest
import torch

from vllm_dartree.bench import tau as tb
from vllm_dartree.testing import write_tiny_drafter, write_tiny_target


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from vllm_dartree.reference.decoder import load_drafter_for
    root = tmp_path_factory.mktemp("tau")
    target_dir = write_tiny_target(root / "target", seed=3)
    drafter_dir = write_tiny_drafter(root / "domino", "domino", target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = load_drafter_for(target, drafter_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in (5, 9, 14)]
    return target, drafter, prompts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_row_runs_and_greedy_rows_equal_ar(models, temperature):
    target, drafter, prompts = models
    cells = {}
    for method, _ in tb.ROWS:
        cell = tb.run_cell(target, drafter, prompts, method, temperature, 12, (), "toy")
        assert cell.output_tokens == 12 * len(prompts) and cell.tau >= 1.0
        cells[tb._key(temperature, "toy", method)] = cell
    assert cells[tb._key(temperature, "toy", "ar")].tau == 1.0
    if temperature == 0.0:
        ar = cells[tb._key(0.0, "toy", "ar")].outputs
        for method, _ in tb.ROWS:
            assert cells[tb._key(0.0, "toy", method)].outputs == ar, method
        report = tb.lossless_report(cells, ["toy"], [m for m, _ in tb.ROWS])
        assert report.startswith("lossless (T = 0): 15/15 ")


def _cell(t, ds, m, tau, tps, outputs=((1, 2),)):
    return tb.Cell(t, ds, m, tau, tps, 2, [list(o) for o in outputs])


def test_table_arithmetic_and_mismatch_report():
    cells = {tb._key(c.temperature, c.dataset, c.method): c for c in [
        _cell(0.0, "a", "ar", 1.0, 10.0), _cell(0.0, "b", "ar", 1.0, 20.0),
        _cell(0.0, "a", "dartree-pruned", 3.0, 30.0), _cell(0.0, "b", "dartree-pruned", 5.0, 20.0,
                                                            outputs=((1, 3),))]}
    table = tb.format_table(cells, 0.0, ["a", "b"], ["ar", "dartree-pruned"])
    rows = table.splitlines()
    assert rows[2] == "| Method | a | b | Avg |"
    assert rows[4] == "| AR | 1.00 (1.00x) | 1.00 (1.00x) | 1.00 (1.00x) |"
    assert rows[5].endswith("| 3.00 (3.00x) | 5.00 (1.00x) | 4.00 (2.00x) |")
    report = tb.lossless_report(cells, ["a", "b"], ["ar", "dartree-pruned"])
    assert report == "lossless (T = 0): 1/2 requests identical to AR  <-- MISMATCH"


def test_cells_file_resumes(tmp_path):
    store = tmp_path / "cells.jsonl"
    a, b = _cell(1.0, "x", "ar", 1.0, 5.0), _cell(1.0, "x", "domino", 2.5, 9.0)
    store.write_text("".join(json.dumps(c.__dict__) + "\n" for c in (a, b)))
    loaded = tb._load_cells(store)
    assert loaded == {tb._key(1.0, "x", "ar"): a, tb._key(1.0, "x", "domino"): b}


def test_weights_fingerprint_follows_the_weights_not_the_path(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    (tmp_path / "notes.txt").write_text("not a weight file")
    first = tb.weights_fingerprint(tmp_path)
    (tmp_path / "notes.txt").write_text("edited")
    assert tb.weights_fingerprint(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 63 + b"\x01")   # retrained in place
    assert tb.weights_fingerprint(tmp_path) != first
