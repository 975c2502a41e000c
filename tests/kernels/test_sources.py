"""Static checks of the kernel sources, on their syntax trees (nothing is imported or compiled).

A kernel is a module-level function named ``*_kernel`` under the
``@triton.jit`` decorator in entmaxkv/kernels/.
"""
from __future__ import annotations

import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "entmaxkv" / "kernels"
# the stage prefix of a kernel, by the module (or package) that defines it
PREFIX = {"attention": "_attn_", "topk": "_topk_", "gaussian": "_gauss_", "certified": "_cert_", "scoring": "_score_",
          "write": "_write_", "prefill": "_prefill_", "sketch": "_sketch_", "model": "_model_"}
# kernels that wait for their own row's producers (poll_start) instead of the whole previous launch
POLLING = {"_topk_rowsel_kernel", "_attn_split_softmax_kernel", "_attn_split_entmax_kernel", "_attn_finish_kernel",
           "_attn_combine_kernel"}


def _is_jit(dec) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(target, ast.Attribute) and target.attr == "jit" and getattr(target.value, "id", "") == "triton"


def kernels():
    """(path, function node) of every kernel in the package."""
    out = []
    for path in sorted(KERNELS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    _is_jit(d) for d in node.decorator_list):
                out.append((path, node))
    return out


def _body(fn):
    """The statements of ``fn`` after its docstring."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def _call_name(stmt):
    """f for a statement that is the call ``f(...)``, else None."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name):
        return stmt.value.func.id
    return None


def _is_pid(stmt) -> bool:
    """``i_x = tl.program_id(n)`` (optionally ``.to(...)``), or ``i_r, i_s = grid_ids(...)``."""
    if not isinstance(stmt, ast.Assign):
        return False
    src = ast.unparse(stmt.value)
    return src.startswith("tl.program_id(") or src.startswith("grid_ids(")


def _is_pdl_start(stmt) -> bool:
    return _call_name(stmt) == "pdl_start" and ast.unparse(stmt.value.args[0]) == "PDL"


def _calls(nodes):
    return {ast.unparse(n.func) for stmt in nodes for n in ast.walk(stmt) if isinstance(n, ast.Call)}


def check_waits_first(fn) -> None:
    """A kernel launched with programmatic dependent launch may start before
    its predecessor finishes, so every kernel taking the PDL switch must wait
    (pdl_start(PDL)) before anything else. The polling forms instead, after
    nothing but their program ids, branch on POLL: poll_start first in that
    branch (after program ids only) and no whole-launch wait (gdc_wait) there,
    pdl_start(PDL) first in the other. Raises AssertionError naming the kernel."""
    name = fn.name
    body = _body(fn)
    if name not in POLLING:
        assert body and _is_pdl_start(body[0]), (name, ast.unparse(body[0]) if body else None)
        return
    k = next(i for i, s in enumerate(body) if not _is_pid(s))
    branch = body[k]
    assert isinstance(branch, ast.If) and ast.unparse(branch.test).startswith("POLL"), (name, ast.unparse(branch))
    j = next(i for i, s in enumerate(branch.body) if not _is_pid(s))
    assert _call_name(branch.body[j]) == "poll_start", (name, ast.unparse(branch.body[j]))
    assert "gdc_wait" not in _calls(branch.body), name
    assert branch.orelse and _is_pdl_start(branch.orelse[0]), (name, ast.unparse(branch))


def test_pdl_kernels_wait_first():
    found = 0
    for _path, fn in kernels():
        if "PDL" in [a.arg for a in fn.args.args]:
            check_waits_first(fn)
            found += 1
    assert found == 20


def test_the_check_fails_on_a_late_wait():
    """The rule above rejects a kernel that touches memory before its wait,
    and a polling kernel that waits for the whole launch in its poll branch."""
    late = ast.parse("def _attn_x_kernel(x_ptr, PDL):\n    tl.store(x_ptr, 0)\n    pdl_start(PDL)\n").body[0]
    poll = ast.parse("def _attn_split_entmax_kernel(x_ptr, POLL, PDL):\n    i_r = tl.program_id(0)\n"
                     "    if POLL:\n        gdc_wait()\n        poll_start(x_ptr, 1, 1, PDL)\n"
                     "    else:\n        pdl_start(PDL)\n").body[0]
    for fn in (late, poll):
        try:
            check_waits_first(fn)
        except AssertionError:
            continue
        raise AssertionError(f"{fn.name} passed the check")


def test_kernels_are_named_by_stage():
    """Every kernel's name starts with its stage's prefix (the module or
    package it lives in: attention _attn_, topk _topk_, gaussian _gauss_,
    certified _cert_, scoring _score_, write _write_, prefill _prefill_,
    sketch _sketch_, model _model_), and no two kernels share a name."""
    seen = {}
    for path, fn in kernels():
        rel = path.relative_to(KERNELS)
        stage = rel.parts[0].removesuffix(".py")
        assert stage in PREFIX and fn.name.startswith(PREFIX[stage]), (str(rel), fn.name)
        assert fn.name not in seen, (fn.name, seen.get(fn.name), str(rel))
        seen[fn.name] = str(rel)
    assert POLLING <= set(seen)


# module-level names that are state or values, not settings
_NOT_SETTINGS = {"__all__", "DEFAULT", "_LAUNCHES", "_ZTAB"}


def test_module_constants_are_compile_time_only():
    """Launch choices are KernelConfig fields: the only other module-level
    constants (upper-case names) in entmaxkv/kernels/ are the ones jit
    functions read as globals, tl.constexpr values (or another such
    constant), each fixed at compile time."""
    constexprs, bad = set(), []
    for path in sorted(KERNELS.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                continue
            name = node.targets[0].id
            if name.lstrip("_").upper() != name.lstrip("_") or name in _NOT_SETTINGS:
                continue
            value = ast.unparse(node.value)
            if value.startswith("tl.constexpr(") or value in constexprs:
                constexprs.add(name)
            else:
                bad.append(f"{path.relative_to(KERNELS)}: {name} = {value}")
    assert not bad, bad
    assert {"INT32_MIN", "INF_KEY", "ATOMIC_SEM", "INLINE_PTX", "_XMAX", "_FAST_DIV"} <= constexprs
