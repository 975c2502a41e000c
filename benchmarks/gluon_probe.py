"""What this Triton offers for a warp-specialised kernel (a script, not a test; GPU only)

    python3 benchmarks/gluon_probe.py

The misses left in issue 3 (docs/kernels.md, "Against the targets") would
need a step kernel whose warps take different roles with different
register budgets: producer warps streaming page metadata at the read
ceiling while consumer warps select and attend the rows already scored.
Plain Triton gives a kernel one register allocation for all its code
(``results/overlap.log``: both roles in one launch read slower than the
keys pass alone). Triton's lower-level dialect Gluon
(``triton.experimental.gluon``) has ``warp_specialize`` with per-partition
warp and register counts. This script records, on the machine it runs on:

* the Triton / torch versions and the GPU;
* the signature of ``gluon.language.warp_specialize`` (it has changed
  between Triton releases; 3.6 on the H200 and 3.9 here both take a list of
  (function, arguments), the default partition first);
* whether a two-partition kernel (a 4-warp default partition and a 1-warp
  worker with its own register count) compiles and writes what it should.

Gluon kernels do not run under ``TRITON_INTERPRET=1`` (on the CPU they fail
with "0 active drivers"), so a kernel written in it could be checked on the
GPU only, not by CI. That is why none is in the library.
"""
from __future__ import annotations

import inspect

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

N = 256


@gluon.jit
def _fill(ptr, val, N: gl.constexpr, W: gl.constexpr):
    """ptr[0:N] = val, by the W warps of the calling partition."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    o = gl.arange(0, N, layout=layout)
    gl.store(ptr + o, gl.full([N], val, gl.int32, layout))


@gluon.jit
def _default_part(ptr, N: gl.constexpr):
    _fill(ptr, 1, N, 4)


@gluon.jit
def _worker_part(ptr, N: gl.constexpr):
    _fill(ptr + N, 2, N, 1)


@gluon.jit
def _ws_pairs(ptr, N: gl.constexpr, REGS: gl.constexpr):
    """A 4-warp default partition writes ptr[0:N] = 1, a 1-warp worker with
    REGS registers per thread ptr[N:2N] = 2."""
    gl.warp_specialize([(_default_part, (ptr, N)), (_worker_part, (ptr, N))], [1], [REGS])


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    params = list(inspect.signature(gl.warp_specialize).parameters)
    print(f"gluon.language.warp_specialize{tuple(params)}")
    for regs in (24, 40):
        out = torch.zeros(2 * N, dtype=torch.int32, device="cuda")
        try:
            _ws_pairs[(1,)](out, N, regs, num_warps=4)
            torch.cuda.synchronize()
        except Exception as exc:  # the record is the point: print why it failed
            print(f"_ws_pairs worker_num_regs={regs}: failed: {type(exc).__name__}: {exc}".splitlines()[0])
            continue
        want = torch.cat([torch.ones(N), torch.full((N,), 2.0)]).to(out)
        print(f"_ws_pairs worker_num_regs={regs}: ran, output {'correct' if torch.equal(out, want) else 'WRONG'}")


if __name__ == "__main__":
    main()
