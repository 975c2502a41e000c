"""The CLI's main job runs and reports sensible numbers."""
from __future__ import annotations

import json
import subprocess
import sys

from entmaxkv.cli import main


def test_demo_json(capsys):
    rc = main(["demo", "--seq-len", "700", "--batch", "2", "--q-heads", "4", "--kv-heads", "2",
               "--head-dim", "16", "--page-size", "8", "--budget", "128", "--dtype", "float32",
               "--device", "cpu", "--repeats", "1", "--json", "--alibi"])
    assert rc == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.strip().splitlines()]
    names = [(r["attention"], r["name"]) for r in rows]
    assert names == [("softmax", "full"), ("softmax", "topk"), ("entmax", "full"),
                     ("entmax", "topk"), ("entmax", "gaussian"), ("entmax", "certified")]
    by = {n: r for n, r in zip(names, rows)}
    for key in ("coverage", "delta", "rho", "R", "time"):
        assert all(isinstance(r[key], float) for r in rows)
    assert by[("softmax", "full")]["R"] < 1e-5 and by[("entmax", "full")]["R"] < 1e-5
    assert by[("entmax", "certified")]["delta"] == 0.0 and by[("entmax", "certified")]["R"] < 1e-5
    assert by[("softmax", "topk")]["delta"] > 0  # softmax always drops mass
    assert abs(by[("entmax", "topk")]["coverage"] - 128 / 700) < 0.05


def test_demo_table_via_module():
    res = subprocess.run([sys.executable, "-m", "entmaxkv", "demo", "--seq-len", "300", "--head-dim", "8",
                          "--device", "cpu", "--repeats", "1", "--policy", "topk"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "coverage" in res.stdout and "topk" in res.stdout and "gaussian" not in res.stdout.split("\n", 3)[-1]


def test_demo_rejects_softmax_alpha(capsys):
    assert main(["demo", "--alpha", "1.0"]) == 2
    err = capsys.readouterr().err
    assert "--alpha" in err and "expected a finite number in (1, 4]" in err
