"""Small versions of every evaluation on randomly initialised tiny twins (CPU)."""
from __future__ import annotations

import argparse
import json

import pytest

from entmaxkv.eval.passkey import add_passkey_args, run_passkey
from entmaxkv.eval.perplexity import add_perplexity_args, run_perplexity
from entmaxkv.eval.quality import add_quality_args, run_quality


def parse(add, argv):
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


def test_quality_small(tmp_path):
    out = tmp_path / "quality.json"
    args = parse(add_quality_args, ["--random-tiny", "--device", "cpu", "--out", str(out),
                                    "--synthetic-lengths", "256", "--synthetic-batch", "1",
                                    "--capture-lengths", "256", "--capture-seqs", "1",
                                    "--capture-steps", "1"])
    assert run_quality(args) == 0
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").exists()
    rows = {(r["source"], r["attention"], r["method"], r["target_coverage"]): r for r in res["rows"]}
    for source in ("synthetic", "captured"):
        # certified is exact: nothing dropped, whole support kept, output equal
        cert = rows[source, "entmax", "certified", None]
        assert cert["delta"]["mean"] == pytest.approx(0.0, abs=1e-6)
        assert cert["rho"]["mean"] == pytest.approx(1.0)
        assert cert["R"]["mean"] < 1e-4
        for c in (0.1, 0.125, 0.25, 0.5):
            assert rows[source, "softmax", "topk", c]["delta"]["mean"] > 0  # softmax always drops mass


def test_passkey_small(tmp_path):
    out = tmp_path / "passkey.json"
    args = parse(add_passkey_args, ["--random-tiny", "--device", "cpu", "--out", str(out),
                                    "--lengths", "256", "--budgets", "32", "--trials", "2"])
    assert run_passkey(args) == 0
    res = json.loads(out.read_text())
    assert res["certified_check"]["all_ok"]
    methods = {(c["model"], c["method"]) for c in res["cells"]}
    assert methods == {("entmax", "full"), ("entmax", "topk"), ("entmax", "gaussian"),
                       ("entmax", "certified"), ("softmax", "full"), ("softmax", "topk")}
    assert all(0.0 <= c["accuracy"] <= 1.0 for c in res["cells"])
    assert out.with_suffix(".png").exists()


def test_perplexity_small(tmp_path):
    out = tmp_path / "perplexity.json"
    args = parse(add_perplexity_args, ["--random-tiny", "--device", "cpu", "--out", str(out),
                                       "--lengths", "256", "--budgets", "32", "64", "--windows", "1",
                                       "--tail", "4"])
    assert run_perplexity(args) == 0
    res = json.loads(out.read_text())
    assert res["certified_check"]["all_ok"]
    rows = {(r["model"], r["method"], r["budget"]): r for r in res["rows"]}
    for twin in ("entmax", "softmax"):  # decoding with the full cache reproduces the forward pass
        assert rows[twin, "full", None]["ppl"] == pytest.approx(rows[twin, "forward", None]["ppl"], rel=1e-4)
    assert rows["entmax", "certified", None]["ppl"] == pytest.approx(rows["entmax", "full", None]["ppl"], rel=1e-5)
    assert out.with_suffix(".png").exists()
