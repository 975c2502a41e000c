"""Rules of the tree that a reviewer would otherwise check by hand.

- No history in the package: no file under entmaxkv/ names a session, a
  date or a commit hash (measurements live in docs/tuning.md, history in git).
- Configuration is passed, not patched: no test sets an upper-case
  (module-level knob) attribute of an entmaxkv module with monkeypatch.
- docs/kernels.md is a design document of at most 500 lines.
"""
from __future__ import annotations

import ast
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


def _patched_knobs(tree: ast.AST):
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "setattr" or len(node.args) < 2:
            continue
        name = node.args[1]
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.isupper():
            yield node.lineno, name.value
        elif not isinstance(name, ast.Constant):
            yield node.lineno, ast.unparse(name)  # a computed name could be a knob


def test_no_test_patches_a_module_knob():
    tests = pathlib.Path(__file__).resolve().parent
    bad = []
    for path in sorted(tests.rglob("test_*.py")):
        for line, name in _patched_knobs(ast.parse(path.read_text())):
            bad.append(f"{path.relative_to(ROOT)}:{line}: setattr(..., {name})")
    assert not bad, "\n".join(bad)


def test_patched_knob_finder_can_fail():
    src = 'monkeypatch.setattr(tk, "ROWSEL", False)\nmonkeypatch.setattr(tk, "launch_rowsel", spy)'
    assert [n for _, n in _patched_knobs(ast.parse(src))] == ["ROWSEL"]


def test_kernels_design_doc_is_short():
    lines = (ROOT / "docs" / "kernels.md").read_text().splitlines()
    assert len(lines) <= 500, len(lines)
