"""Bad command-line input: one clear line on stderr, no traceback, non-zero exit.

Every command (``entmaxkv demo | generate | quality | passkey | perplexity``,
the evaluations' own ``python -m entmaxkv.eval.<name>`` and the trainer's
``python -m entmaxkv.model.train``) is run in-process through its ``main``
with a grid of bad flags: every numeric flag with the values its help rules
out among 0, a negative, nan, inf, a fraction and a non-number, unknown
choices, paths that do not exist, and flag combinations that cannot work.
Each run must exit non-zero with exactly one line on stderr that names the
flag, and must not start any work (the base arguments are small, so a flag
that slipped through would still finish quickly, and be reported here). A
few runs go through a real interpreter to check the process's exit status.
"""
from __future__ import annotations

import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from entmaxkv import cli
from entmaxkv.eval import passkey as ev_passkey
from entmaxkv.eval import perplexity as ev_perplexity
from entmaxkv.eval import quality as ev_quality
from entmaxkv.model import train as model_train

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints"
MISSING = "/nonexistent/entmaxkv-test-path"

POS_INT = ["0", "-1", "1.5", "nan", "inf", "x"]  # an int >= 1
NONNEG_INT = ["-1", "1.5", "nan", "x"]  # an int >= 0
POS_FLOAT = ["0", "-1", "nan", "inf", "x"]  # a finite number > 0
NONNEG_FLOAT = ["-1", "nan", "inf", "x"]  # a finite number >= 0
OPEN_UNIT = ["0", "1", "-0.5", "1.5", "nan", "inf", "x"]  # a number in (0, 1)
UNIT = ["-0.5", "1.5", "nan", "inf", "x"]  # a number in [0, 1]
ALPHA = ["1", "0.5", "-1", "4.5", "nan", "inf", "x"]  # a finite number in (1, ALPHA_MAX]
DEVICE = ["tpu", "cuda:99", "", "cpu:x"]
if not torch.cuda.is_available():
    DEVICE.append("cuda")


def _flags(table):
    """{flag: bad values} -> [(flag, [flag, value])]."""
    return [(flag, [flag, v]) for flag, values in table.items() for v in values]


DEMO_BASE = ["demo", "--seq-len", "64", "--head-dim", "8", "--repeats", "1", "--device", "cpu", "--json"]
DEMO = _flags({
    "--seq-len": POS_INT, "--batch": POS_INT, "--q-heads": POS_INT, "--kv-heads": POS_INT,
    "--head-dim": POS_INT, "--page-size": POS_INT, "--dtype": ["float8", "x"], "--device": DEVICE,
    "--seed": NONNEG_INT, "--data": ["uniform"], "--cluster": POS_INT, "--noise": NONNEG_FLOAT,
    "--q-scale": POS_FLOAT, "--alpha": ALPHA, "--budget": POS_INT, "--q-max": OPEN_UNIT,
    "--margin": NONNEG_FLOAT, "--sinks": NONNEG_INT, "--window": NONNEG_INT, "--policy": ["dense", "x"],
    "--repeats": POS_INT,
}) + [
    ("--q-heads", ["--q-heads", "6", "--kv-heads", "4"]),  # not a multiple
    ("--budget", ["--budget", "8", "--page-size", "16"]),  # less than a page
]

GEN_BASE = ["generate", "--checkpoint", str(CKPT / "entmax"), "--max-new-tokens", "1", "--device", "cpu"]
GENERATE = _flags({
    "--max-new-tokens": POS_INT, "--temperature": NONNEG_FLOAT, "--top-k": NONNEG_INT,
    "--top-p": ["0", "-0.5", "1.5", "nan", "inf", "x"], "--seed": NONNEG_INT, "--device": DEVICE,
    "--page-size": POS_INT, "--cache-dtype": ["float8"], "--backend": ["gpu"], "--policy": ["dense"],
    "--budget": POS_INT, "--q-max": OPEN_UNIT, "--margin": NONNEG_FLOAT,
    "--checkpoint": [MISSING, str(ROOT)], "--prompt-file": [MISSING, str(ROOT)],
}) + [
    ("--prompt", ["--prompt", ""]),
    ("--budget", ["--budget", "8", "--page-size", "16", "--policy", "topk"]),
    ("--policy", ["--checkpoint", str(CKPT / "softmax"), "--policy", "gaussian"]),
]


def _eval_common(extra):
    return {"--page-size": POS_INT, "--seed": NONNEG_INT, "--device": DEVICE, "--backend": ["gpu"],
            "--checkpoints": [MISSING, str(ROOT)], **extra}


QUALITY_BASE = ["quality", "--out", "@OUT", "--random-tiny", "--device", "cpu", "--no-plot", "--synthetic-lengths", "64",
                "--synthetic-batch", "1", "--capture-lengths", "256", "--capture-seqs", "1",
                "--capture-steps", "1"]
QUALITY = _flags(_eval_common({
    "--coverages": ["0", "-0.1", "1.5", "nan", "x"], "--synthetic-lengths": POS_INT,
    "--synthetic-batch": POS_INT, "--capture-lengths": POS_INT + ["16"], "--capture-seqs": POS_INT,
    "--capture-steps": POS_INT, "--q-max": OPEN_UNIT, "--margin": NONNEG_FLOAT, "--alpha": ALPHA,
}))
PASSKEY_BASE = ["passkey", "--out", "@OUT", "--random-tiny", "--device", "cpu", "--no-plot", "--lengths", "256",
                "--budgets", "32", "--trials", "1"]
PASSKEY = _flags(_eval_common({
    "--lengths": POS_INT + ["16"], "--budgets": POS_INT, "--trials": POS_INT, "--q-max": OPEN_UNIT,
    "--margin": NONNEG_FLOAT, "--certified-seed-budget": POS_INT,
})) + [
    ("--budgets", ["--budgets", "8", "--page-size", "16"]),
    ("--certified-seed-budget", ["--certified-seed-budget", "8", "--page-size", "16"]),
]
PPL_BASE = ["perplexity", "--out", "@OUT", "--random-tiny", "--device", "cpu", "--no-plot", "--lengths", "256",
            "--budgets", "32", "--windows", "1", "--tail", "2"]
PERPLEXITY = _flags(_eval_common({
    "--lengths": POS_INT, "--budgets": POS_INT, "--windows": POS_INT, "--tail": POS_INT,
    "--q-max": OPEN_UNIT, "--margin": NONNEG_FLOAT, "--certified-seed-budget": POS_INT,
})) + [
    ("--tail", ["--tail", "300", "--lengths", "256"]),  # no prefix left to prefill
    ("--windows", ["--windows", "100000"]),  # more text than the test split holds
]

TRAIN_BASE = ["--out", "@OUT", "--steps", "1", "--batch", "1", "--seq-len", "256", "--d-model", "16", "--n-layers", "1",
              "--n-heads", "2", "--n-kv-heads", "1", "--d-ff", "16", "--val-windows", "1",
              "--log-every", "1", "--device", "cpu"]
TRAIN = _flags({
    "--steps": POS_INT, "--time-budget": POS_FLOAT, "--calib-steps": POS_INT + ["3"], "--batch": POS_INT,
    "--seq-len": POS_INT, "--lr": POS_FLOAT, "--min-lr-ratio": UNIT, "--warmup": NONNEG_INT,
    "--weight-decay": NONNEG_FLOAT, "--grad-clip": POS_FLOAT, "--p-passkey": UNIT,
    "--answer-weight": NONNEG_FLOAT, "--p-copy": UNIT, "--chunk": POS_INT, "--log-every": POS_INT,
    "--d-model": POS_INT, "--n-layers": POS_INT, "--n-heads": POS_INT + ["3"], "--n-kv-heads": POS_INT + ["3"],
    "--d-ff": POS_INT, "--alpha": ALPHA, "--val-windows": POS_INT, "--device": DEVICE,
    "--init-from": [MISSING], "--seed": NONNEG_INT, "--positions": ["sinusoidal"],
}) + [
    ("--p-copy", ["--p-passkey", "0.7", "--p-copy", "0.5"]),  # more than all rows
    ("--seq-len", ["--seq-len", "64"]),  # shorter than the shortest passkey example
]


def _grid():
    rows = []
    for name, main, base, table in [
        ("entmaxkv", cli.main, DEMO_BASE, DEMO),
        ("entmaxkv", cli.main, GEN_BASE, GENERATE),
        ("entmaxkv", cli.main, QUALITY_BASE, QUALITY),
        ("entmaxkv", cli.main, PASSKEY_BASE, PASSKEY),
        ("entmaxkv", cli.main, PPL_BASE, PERPLEXITY),
        ("eval.quality", ev_quality.main, QUALITY_BASE[1:], QUALITY[:6]),
        ("eval.passkey", ev_passkey.main, PASSKEY_BASE[1:], PASSKEY[:6]),
        ("eval.perplexity", ev_perplexity.main, PPL_BASE[1:], PERPLEXITY[-8:]),
        ("model.train", model_train.main, TRAIN_BASE, TRAIN),
    ]:
        cmd = base[0] if name == "entmaxkv" else name
        for flag, argv in table:
            rows.append(pytest.param(main, base, flag, argv, id=f"{cmd} {' '.join(argv)}"))
    return rows


GRID = _grid()


def run_main(main, argv, capsys):
    """(exit status, stderr) of ``main(argv)`` as the console script would see
    them: SystemExit is an exit status, any other exception a traceback."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except Exception:  # noqa: BLE001 - the test reports what the user would see
        print(traceback.format_exc(), file=sys.stderr)
        rc = 1
    err = capsys.readouterr().err
    return rc, err


def _lines(err: str):
    return [line for line in err.splitlines() if line.strip()]


def test_the_grid_is_large_enough():
    assert len(GRID) >= 59 * 3
    flags = {p.values[2] for p in GRID}
    assert len(flags) >= 59


@pytest.mark.parametrize("main,base,flag,argv", GRID)
def test_bad_flag_gives_one_line_naming_it(main, base, flag, argv, capsys, tmp_path):
    full = [str(tmp_path / "out") if a == "@OUT" else a for a in base]
    if flag == "--checkpoints":  # the twins are read only without --random-tiny
        full.remove("--random-tiny")
    rc, err = run_main(main, full + argv, capsys)
    assert "Traceback" not in err, err
    assert rc not in (0, None), f"exit status {rc}; stderr: {err}"
    lines = _lines(err)
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert flag in lines[0], f"{lines[0]!r} does not name {flag}"
    assert re.match(r"^[\w .-]+: error: ", lines[0]), lines[0]


def test_out_that_is_a_folder_is_rejected(capsys, tmp_path):
    rc, err = run_main(cli.main, [str(tmp_path) if a == "@OUT" else a for a in PASSKEY_BASE], capsys)
    assert rc == 2 and len(_lines(err)) == 1 and "--out" in err and "Traceback" not in err


def test_library_value_error_reaching_main_is_one_line(capsys):
    """Whatever ValueError the library raises while a command runs is printed
    as one line with exit status 2 (the flags were fine, the input was not)."""

    def boom(args):
        raise ValueError("alpha: outside the supported range\n(second line of detail)")

    parser = cli.Parser(prog="entmaxkv demo")
    parser.set_defaults(func=boom)
    rc = cli.run(parser, [])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert _lines(err) == ["entmaxkv demo: error: alpha: outside the supported range (second line of detail)"]


def test_alpha_just_above_one_runs(capsys):
    """1 < alpha < 1.0058 once overflowed the Gaussian estimate's gamma
    function; the demo (which runs every policy) now completes."""
    rc, err = run_main(cli.main, DEMO_BASE + ["--alpha", "1.0001", "--seq-len", "64"], capsys)
    assert rc == 0 and "Traceback" not in err, err


# ------------------------------------------------------------------ real processes


@pytest.mark.parametrize("argv,flag", [
    (["-m", "entmaxkv", "demo", "--page-size", "0"], "--page-size"),  # an argparse type error
    (["-m", "entmaxkv.eval.perplexity", "--random-tiny", "--tail", "300", "--lengths", "256"], "--tail"),
])
def test_process_exit_status_and_stderr(argv, flag):
    res = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    lines = _lines(res.stderr)
    assert len(lines) == 1 and flag in lines[0], res.stderr


# ------------------------------------------------------------------ --help


COMMANDS = ["demo", "generate", "quality", "passkey", "perplexity", "bench"]


def test_commands_match_readme():
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"`entmaxkv ((?:\w+ \| )+\w+)`", readme).group(1).split(" | ")
    assert listed == COMMANDS
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert list(sub.choices) == COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_help_works_and_lists_the_readme_flags(command, capsys):
    rc = cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith(f"usage: entmaxkv {command}")
    readme = (ROOT / "README.md").read_text()
    used = set()
    for line in re.findall(rf"entmaxkv {command}\b[^`\n]*", readme):
        used |= set(re.findall(r"--[a-z][a-z-]*", line))
    for flag in used:
        assert flag in out, f"README uses {flag} for {command}, --help does not list it"


def test_top_level_help_and_version(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in COMMANDS)
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("entmaxkv ")
    rc, err = run_main(cli.main, [], capsys)
    assert rc == 2 and len(_lines(err)) == 1 and "Traceback" not in err
