"""Compile every kernel specialization a set of decode steps launches, for a GPU
target, on a machine without one (a script, not a test).

First (in a subprocess, on Triton's CPU interpreter) it runs decode steps
over every policy, alpha 1 / 1.5 / 2 / 1.25 / 4/3, one and several query heads per
KV head, fp16 / bf16 / fp32, with and without ALiBi, and the launch paths
the configs in ``run_cases`` switch on, recording each kernel launch (its
arguments' types, constexprs, num_warps and num_stages). Then, without the
interpreter (so inline PTX is on, as on the GPU), it compiles each distinct
specialization with ``triton.compile`` for the target (default sm_90, the
H200), with PDL off as recorded and on, and prints per kernel the number of
specializations and the largest register count and local (spill) bytes
from ``cuobjdump -res-usage``, so that two trees can be compared. The block
sizes are the interpreter's plans (what the test suite launches), not the
GPU's. Exits 1 if any specialization fails to compile.

    python -m benchmarks.compile_check [--arch 90] [--out table.json] [--specs specs.json] [--where BETA_KIND=2]

``--specs FILE`` keeps the recorded specializations there, or, when FILE
exists, compiles those without recording again (the recording is the slow
part; Triton's cache serves specializations compiled before). ``--where
NAME=VALUE`` keeps only the specializations with that constexpr (JSON text:
``BETA_KIND=2`` the 1.5-entmax ones, ``SOFTMAX=false``), to compare one
path's registers between two trees.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}


def record(path: str) -> None:
    """Run ``run_cases`` on the interpreter and write the launched
    specializations to ``path`` (JSON: module, kernel, signature, constexprs, options)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen = {}
    real = InterpretedFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        names = list(self.arg_names)
        opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        sig, consts = {}, {}
        for name in names:
            if name not in bound:
                continue  # a parameter left at its default
            v = bound[name]
            if "constexpr" in str(fn.__annotations__.get(name, "")):
                consts[name] = v
                sig[name] = "constexpr"
            elif isinstance(v, torch.Tensor):
                sig[name] = "*" + _DTYPES[v.dtype]
            elif isinstance(v, bool):
                sig[name] = "i1"
            elif isinstance(v, int):
                sig[name] = "i64" if abs(v) >= 2**31 else "i32"
            elif isinstance(v, float):
                sig[name] = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
        spec = dict(module=fn.__module__, kernel=fn.__name__, signature=sig, constexprs=consts, options=opts)
        seen.setdefault(json.dumps(spec, sort_keys=True), spec)
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = spy
    try:
        run_cases()
    finally:
        InterpretedFunction.run = real
    with open(path, "w") as f:
        json.dump(list(seen.values()), f)


def run_cases():
    """Decode steps over the launch paths (small shapes: the interpreter is slow)."""
    from entmaxkv import Certified, Full, Gaussian, TopK, decode
    from entmaxkv.kernels import AttentionConfig, KernelConfig, TopKConfig
    from entmaxkv.testing import random_case

    # alpha 1.25 and 3.0: the log1p and float64 forms of the entmax passes
    base = [(Full(), (1.0, 1.5, 2.0, 1.25, 3.0)), (TopK(128), (1.0, 1.5, 2.0, 1.25, 3.0)),
            (TopK(64, sinks=1, window=1, per_query_head=True), (1.0, 1.5)),
            (Gaussian(), (1.5, 2.0, 4.0 / 3.0)), (Gaussian(pooled=True), (1.5,)),
            (Certified(), (1.5, 2.0)), (Certified(seed=Gaussian()), (1.5,))]
    attention = [(Full(), (1.5, 2.0, 1.25)), (TopK(128), (1.5, 2.0, 1.25))]
    topk = [(TopK(128), (1.5,)), (Certified(), (1.5,))]
    variants = [(KernelConfig(), base, True),
                (KernelConfig(attention=AttentionConfig(finish=False)), attention, False),
                (KernelConfig(attention=AttentionConfig(finish_prune=False, solve_tile=64)), attention, False),
                (KernelConfig(attention=AttentionConfig(solve_in_regs=False, prefetch_pages=False,
                                                        fused_sums_interpreted=True)), attention, False),
                (KernelConfig(topk=TopKConfig(rowsel=False)), topk, False),
                (KernelConfig(topk=TopKConfig(overlap_needs_pdl=False)), topk, False),
                (KernelConfig(topk=TopKConfig(all_heads=False)), topk, False),
                (KernelConfig(topk=TopKConfig(keys_gqa=False)), topk, False)]
    for G, D, P, dtype, lens in [(1, 32, 16, torch.float16, [600, 37]), (4, 128, 16, torch.bfloat16, [400, 19]),
                                 (2, 64, 8, torch.float32, [300, 5])]:
        cache, ids, q, sl = random_case(lens, 2, G, D, P, dtype, seed=G, slopes=True)
        for cfg, cases, both in variants:
            for pol, alphas in cases:
                for alpha in alphas:
                    for slopes in ((None, sl) if both else (sl,)):
                        decode(q, cache, ids, pol, alpha=alpha, alibi_slopes=slopes, backend="triton",
                               return_stats=True, kernel_config=cfg)
        # the slot-mapping write: one token per page (the incremental step) and a chunk
        k = torch.randn(2, 2, D).to(dtype)
        cache.write(k, k, cache.reserve(ids.tolist()), backend="triton")
        k = torch.randn(2 * P + 1, 2, D)
        cache.write(k, k, cache.reserve(ids.tolist()[:1], 2 * P + 1), backend="triton")
    # rows of more chunks than one (the interpreter's chunks are 256 pages): the chain's merge
    cache, ids, q, sl = random_case([700, 9], 2, 2, 16, 2, torch.float16, seed=5, slopes=True)
    for cfg in (KernelConfig(), KernelConfig(topk=TopKConfig(merge_regs=1))):
        decode(q, cache, ids, TopK(128), alpha=1.5, alibi_slopes=sl, backend="triton", kernel_config=cfg)


def _resources(cubin: bytes, cuobjdump: str):
    """(registers, local bytes) of a cubin's one function."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", text)
    local = re.search(r"LOCAL:(\d+)", text)
    return int(reg.group(1)), int(local.group(1))


def compile_all(specs, arch: int):
    """{kernel: [specializations, max registers, max local bytes, failures]}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    target = GPUTarget("cuda", arch, 32)
    out = collections.defaultdict(lambda: [0, 0, 0, []])
    for spec in specs:
        jit = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        consts = spec["constexprs"]
        runs = [(consts, spec["options"])]
        if "PDL" in consts:  # as launched on sm_90 with programmatic dependent launch
            runs.append((dict(consts, PDL=True), dict(spec["options"], launch_pdl=True)))
        for cx, opts in runs:
            row = out[spec["kernel"]]
            row[0] += 1
            try:
                kernel = triton.compile(ASTSource(jit, signature=spec["signature"], constexprs=cx), target=target,
                                        options=opts)
                regs, local = _resources(kernel.asm["cubin"], cuobjdump)
                row[1], row[2] = max(row[1], regs), max(row[2], local)
            except Exception as exc:  # noqa: BLE001  (report every failure, not the first)
                row[3].append(f"{type(exc).__name__}: {str(exc)[:300]} (constexprs {cx})")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability as one number (90: sm_90)")
    ap.add_argument("--out", default=None, help="write the per-kernel table as JSON")
    ap.add_argument("--specs", default=None, help="keep the recorded specializations here (or reuse them)")
    ap.add_argument("--where", action="append", default=[], metavar="NAME=VALUE",
                    help="compile only the specializations with this constexpr value (e.g. BETA_KIND=2, the "
                         "1.5-entmax ones); repeatable, all must hold")
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)  # (the subprocess's part)
    args = ap.parse_args(argv)
    if args.record:
        record(args.record)
        return 0
    if args.specs and os.path.exists(args.specs):
        with open(args.specs) as f:
            specs = json.load(f)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = args.specs or os.path.join(tmp, "specs.json")
            env = dict(os.environ, TRITON_INTERPRET="1")
            subprocess.run([sys.executable, "-m", "benchmarks.compile_check", "--record", path], env=env,
                           check=True)
            with open(path) as f:
                specs = json.load(f)
    for cond in args.where:
        name, _, value = cond.partition("=")
        if not name or not value:
            raise SystemExit(f"compile_check: --where expects NAME=VALUE, got {cond!r}")
        # (constexprs are recorded as JSON values: compare their JSON text)
        specs = [s for s in specs if name in s["constexprs"] and json.dumps(s["constexprs"][name]) == value]
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("compile_check: run it without TRITON_INTERPRET (the compile step needs the real jit)")
    table = compile_all(specs, args.arch)
    failed = 0
    print(f"{'kernel':32s} {'specs':>5s} {'regs':>5s} {'local':>6s}")
    for name, (n, regs, local, errors) in sorted(table.items()):
        print(f"{name:32s} {n:5d} {regs:5d} {local:6d}" + (f"  {len(errors)} FAILED" if errors else ""))
        for e in errors[:3]:
            print("    " + e)
        failed += len(errors)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({k: v[:3] for k, v in table.items()}, f, indent=1, sort_keys=True)
    print(f"{sum(v[0] for v in table.values())} specializations of {len(table)} kernels compiled for "
          f"sm_{args.arch}, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
