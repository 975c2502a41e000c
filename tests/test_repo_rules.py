"""Rules of the tree that a reviewer would otherwise check by hand.

- No history in the package: no file under entmaxkv/ names a session, a
  date or a commit hash (measurements live in docs/tuning.md, history in git).
- Launch choices are passed as configs: no test changes a module's
  attributes (monkeypatch, setattr) and no benchmark evals its options.
- docs/kernels.md stays the design, at most 500 lines.
"""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "entmaxkv"

_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# "session" as in a work session; a decode session (model/generate.py) is an object
_SESSION = re.compile(r"(?<!decode )\bsessions?\b", re.IGNORECASE)
# a word of 7-40 hex digits with both a letter and a digit, not a 0x literal
_HASH = re.compile(r"(?<![0-9A-Za-z_.])(?!0x)(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")


def _package_files():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_rules_find_what_they_forbid():
    assert _DATE.search("measured 2026-12-01") and _SESSION.search("the fourth session")
    assert not _SESSION.search("a decode session over per-layer caches")
    assert _HASH.search("as of commit 1e6bc7a") and not _HASH.search("INF_KEY = 0x7F800000")
    assert not _HASH.search("float16 bfloat16 deadbeef")  # letters only is a word, not a hash
    assert not _HASH.search("x * 1.1920928955078125e-07")  # digits of a float literal


def test_no_history_in_the_package():
    bad = []
    for path in _package_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for rx in (_DATE, _SESSION, _HASH):
                if rx.search(line):
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


TESTS = ROOT / "tests"
BENCHMARKS = ROOT / "benchmarks"
# a test that changes a module's attribute (monkeypatch.setattr, setattr) instead of passing a config
_PATCH = re.compile(r"\bmonkeypatch\b|\bsetattr\(")
# eval / exec of text built from options (ast.literal_eval reads literals only)
_EVAL = re.compile(r"(?<![\w.])(eval|exec)\(")


def test_rules_find_patches_and_eval():
    assert _PATCH.search('monkeypatch.setattr(A, "FINISH", False)') and _PATCH.search("setattr(mod, name, v)")
    assert _EVAL.search('eval(f"{mod}.{name} = {value}")') and not _EVAL.search("ast.literal_eval(text)")


def test_no_test_patches_a_module_and_no_benchmark_evals():
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == "test_repo_rules.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if _PATCH.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    for path in sorted(BENCHMARKS.rglob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if _EVAL.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)



def test_kernel_design_doc_is_short():
    lines = (ROOT / "docs" / "kernels.md").read_text().splitlines()
    assert len(lines) <= 500, len(lines)
