"""Fixtures shared by the kernel tests (tests/kernels/test_<stage>.py).

The kernels run on Triton's CPU interpreter here (tests/conftest.py); a test
chooses a launch path by passing a ``KernelConfig``, never by changing a
module, and checks which kernels ran with ``launches``.
"""
from __future__ import annotations

import importlib
import pkgutil

import pytest

triton = pytest.importorskip("triton")


def _kernels():
    """Every ``*_kernel`` jit function of the entmaxkv.kernels package, by name."""
    import entmaxkv.kernels as pkg

    found = {}
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        mod = importlib.import_module(info.name)
        for name, fn in vars(mod).items():
            if name.endswith("_kernel") and isinstance(fn, triton.runtime.KernelInterface):
                found[name] = fn
    return found


class Launches(list):
    """Kernel launches in order, each (kernel name, positional args, keyword
    args, snap()): ``snap`` (None: no snapshot) runs at each launch, before
    the kernel, for state a test wants to see as the kernel found it."""

    snap = None

    def names(self):
        return [rec[0] for rec in self]


@pytest.fixture
def launches():
    """The package's kernels launched while the test runs (``Launches``),
    recorded by Triton's pre-run hooks, added here and removed after the test."""
    seen = Launches()
    hooked = []
    for name, fn in _kernels().items():
        def hook(*args, _name=name, **kwargs):
            seen.append((_name, args, kwargs, seen.snap() if seen.snap is not None else None))
        fn.add_pre_run_hook(hook)
        hooked.append((fn, hook))
    yield seen
    for fn, hook in hooked:
        fn.pre_run_hooks.remove(hook)
