"""Static checks of the kernel sources."""
from __future__ import annotations

import importlib  # noqa: F401
import sys  # noqa: F401

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402,F401

import entmaxkv.kernels as K  # noqa: E402
from entmaxkv import Certified, Full, Gaussian, TopK, decode  # noqa: E402,F401
from entmaxkv import attention as RA  # noqa: E402,F401
from entmaxkv import policies as RP  # noqa: E402,F401
from entmaxkv import scoring as RS  # noqa: E402,F401
from entmaxkv.testing import DEVICE as DEV, KERNEL_TOL as TOL, alibi, page_sets, random_cache, rel_err  # noqa: E402,F401
from entmaxkv.testing import random_case as case  # noqa: E402
from entmaxkv.cache import PagedKVCache  # noqa: E402,F401
from entmaxkv.gaussian import pooled_moments, solve_tau_hat  # noqa: E402,F401
from entmaxkv.types import Pending, Selection  # noqa: E402,F401

# The interpreter evaluates both sides of tl.where, e.g. -inf - (-inf) on masked lanes.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

def test_pdl_kernels_wait_first():
    """A kernel launched with programmatic dependent launch may start before
    its predecessor finishes: every kernel taking the PDL switch must call
    pdl_start(PDL) (the wait) before anything else, except the polling
    forms (_rowsel_kernel after the keys pass, the attention's split and
    finishing kernels after the selection), which, after nothing but their
    program ids, must poll (poll_start) with no whole-launch wait, and take
    pdl_start otherwise."""
    import inspect
    import re

    import triton

    pid = r"i_\w+ = tl\.program_id\(\d\)(\.to\(tl\.int64\))?"
    polling = {"_rowsel_kernel", "_split_kernel", "_finish_kernel", "_combine_kernel"}
    found = 0
    for name in ("topk", "attention", "gaussian", "certified"):
        mod = importlib.import_module(f"entmaxkv.kernels.{name}")
        for attr in dir(mod):
            fn = getattr(mod, attr)
            is_kernel = attr.endswith("_kernel") and isinstance(fn, triton.runtime.KernelInterface)
            if is_kernel and "PDL" in fn.arg_names:
                src = inspect.getsource(fn.fn)
                body = src.split('"""')[-1] if src.count('"""') >= 2 else src.split("):", 1)[1]
                lines = [ln.split("#")[0].strip() for ln in body.splitlines()]  # (no "#" in kernel strings)
                lines = [ln for ln in lines if ln]
                if attr in polling:
                    k = next(i for i, ln in enumerate(lines) if ln.startswith("if POLL"))
                    assert all(re.fullmatch(pid + r"|i_r, i_s = grid_ids\(ROWS_FIRST\)", ln) for ln in lines[:k]), \
                        (attr, lines[:k])
                    branch = lines[k + 1:lines.index("else:", k)]
                    j = next(i for i, ln in enumerate(branch) if ln.startswith("poll_start("))
                    assert all(re.fullmatch(pid, ln) for ln in branch[:j]), (attr, branch)
                    assert not any("gdc_wait" in ln for ln in branch), (attr, branch)
                    assert lines[lines.index("else:", k) + 1] == "pdl_start(PDL)", attr
                else:
                    assert lines[0] == "pdl_start(PDL)", (attr, lines[0])
                found += 1
    assert found == 18
