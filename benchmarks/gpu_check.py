"""GPU check of every kernel against the pure-PyTorch reference (run on the device).

Sweeps dtypes, head dims 32/64/128/256, page sizes, GQA groups, alpha, ALiBi
and per-query-head selection on medium shapes, compares each stage with the
reference (entmaxkv.scoring / policies / attention, float64 queries), checks
that a CUDA-graph replay of a whole decode step matches the eager call, and
prints one line per case plus a summary; exits 1 on any failure. Large
shapes (batch 8 x 512k and 1M tokens) are checked by
``bench_decode.py --check``.

    python -m benchmarks.gpu_check [--quick] [--only overlapped,finish,...]

``--only`` runs just the named sweeps: ``cases`` (the per-case grid),
``overlapped`` (the overlapped top-k step replayed many times), ``dense``
(the dense one-head sweep), ``finish``.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time

import torch

from .harness import capture
from entmaxkv import attention as RA
from entmaxkv import policies as RP
from entmaxkv import scoring as RS
from entmaxkv.cache import PagedKVCache

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def sets(sel):
    B, S, _ = sel.pages.shape
    c = sel.counts.cpu()
    p = sel.pages.cpu()
    return [[frozenset(p[b, s, : int(c[b, s])].tolist()) for s in range(S)] for b in range(B)]


def alibi(n):
    """The geometric ALiBi slopes of n heads, float32 on the GPU."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / n) for i in range(n)], device="cuda")


def make(lens, H, G, D, P, dtype, seed, key_scale=1.5):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = max(lens)
    k = torch.randn(len(lens), n, H, D, device="cuda", generator=gen) * key_scale
    v = torch.randn(len(lens), n, H, D, device="cuda", generator=gen)
    cache, slots = PagedKVCache.from_dense(k, v, lens, P, dtype=dtype, spare_pages=5, shuffle=True,
                                           generator=torch.Generator().manual_seed(seed), device="cuda")
    q = (torch.randn(len(lens), H * G, D, device="cuda", generator=gen) * 1.5).to(dtype)
    return cache, torch.tensor(slots, dtype=torch.int32, device="cuda"), q


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="cases,overlapped,dense,finish",
                    help="comma-separated sweeps to run (default: all): cases, overlapped, dense, finish")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    from entmaxkv import kernels as K

    fails = []
    n_cases = 0

    def report(name, ok, msg):
        nonlocal n_cases
        n_cases += 1
        if not ok:
            fails.append(f"{name}: {msg}")
        print(("ok   " if ok else "FAIL ") + name + "  " + msg, flush=True)

    t0 = time.time()
    dims = [32, 64, 128, 256]
    grid = list(itertools.product(
        [torch.float16, torch.bfloat16, torch.float32], dims, [(2, 1), (2, 4)], [8, 16, 128]))
    if args.quick:
        grid = [(torch.float16, 32, (2, 1), 16), (torch.bfloat16, 128, (2, 4), 16),
                (torch.float32, 64, (2, 4), 8), (torch.float16, 256, (2, 1), 128)]
    for case_i, (dtype, D, (H, G), P) in enumerate(grid if "cases" in only else []):
        try:
            run_case(case_i, dtype, D, H, G, P, K, report)
        except Exception as exc:  # noqa: BLE001  (a compile error must not hide the other cases)
            report(f"case {case_i} {dtype} D{D} H{H}G{G} P{P}", False, f"{type(exc).__name__}: {str(exc)[:300]}")
    sweeps = (("overlapped", "overlapped top-k sweep", check_overlapped),
              ("dense", "dense one-head sweep", check_dense_one_head), ("finish", "finish sweep", check_finish))
    for key, name, sweep in sweeps:
        if key not in only:
            continue
        try:
            sweep(K, report, dims)
        except Exception as exc:  # noqa: BLE001
            report(name, False, f"{type(exc).__name__}: {str(exc)[:300]}")
    print(f"\n{n_cases - len(fails)}/{n_cases} checks passed in {time.time() - t0:.0f}s")
    for f in fails[:40]:
        print("  " + f)
    return 1 if fails else 0


def check_dense(K, report, name, q, cache, ids, alpha, scale, slopes):
    """Dense decode (``K.dense_attend``) against the reference over every page:
    output within the dtype's tolerance, tau within 1e-4."""
    o, tau = K.dense_attend(q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
    full = RP.select(RP.Full(), q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
    ro, rtau = RA.attend(q.double(), cache, ids, full, alpha=alpha, scale=scale, slopes=slopes)
    e, te = rel(o, ro), float((tau.double() - rtau).abs().max())
    report(name, e < TOL[q.dtype] and te < 1e-4, f"rel {e:.1e} tau {te:.1e}")


def check_overlapped(K, report, dims, replays=50):
    """The top-k step through _rowsel_kernel, which publishes each row for
    the attention to poll (Selection.pending), overlapped with the keys pass
    (batch >= 2, rows of at most 32768 pages: _keys_kernel raising a
    counter per batch row, _rowsel_kernel polling it) or not (batch 1, long
    rows):
    pages equal to the reference policy's, the output close to the float64
    reference, and a CUDA graph of the step replayed ``replays`` times with
    every replay's output bit-equal to the eager step's (a read before its
    producer's write, or a write into memory a running launch still uses,
    would show as a replay that differs). Benchmark-like rows (24 heads of d 32,
    fp16, page 16) and odd ones (other dtypes, head dims, page sizes, ALiBi,
    sinks / window, general alpha)."""
    del dims
    shapes = [  # (lens, H, D, P, dtype, alibi, policy, alphas)
        ([32768] * 8, 24, 32, 16, torch.float16, False, RP.TopK(1024), (1.0, 1.5)),
        ([32768] * 8, 24, 32, 16, torch.float16, False, RP.TopK(4096, sinks=1, window=2), (1.5, 2.0)),
        ([20001, 5, 9000, 17], 6, 64, 8, torch.bfloat16, True, RP.TopK(512, sinks=2, window=1), (1.0, 1.3)),
        ([7000, 12345, 33], 4, 128, 64, torch.float32, False, RP.TopK(2048), (1.5, 1.0)),
        # not overlapped (batch 1; rows past OVERLAP_MAX_KEYS): _gmax_kernel zeroes the counters
        ([300000], 24, 32, 16, torch.float16, False, RP.TopK(1024), (1.0, 1.5)),
        ([600000, 250001], 4, 64, 16, torch.bfloat16, True, RP.TopK(1024, sinks=1, window=2), (2.0, 1.0)),
    ]
    for i, (lens, H, D, P, dtype, has_alibi, pol, alphas) in enumerate(shapes):
        cache, ids, q = make(lens, H, 1, D, P, dtype, seed=100 + i)
        scale = 1.0 / math.sqrt(D)
        slopes = alibi(H) if has_alibi else None
        tag = f"B{len(lens)} n{max(lens)} H{H} D{D} P{P} {str(dtype)[6:]}{' alibi' if has_alibi else ''} k{pol.budget}"
        for alpha in alphas:
            sel = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
            rsel = RP.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
            same = sets(sel) == sets(rsel)
            eo, etau = K.attend(q, cache, ids, sel, alpha=alpha, scale=scale, slopes=slopes)
            ro, _ = RA.attend(q.double(), cache, ids, rsel, alpha=alpha, scale=scale, slopes=slopes)
            e = rel(eo, ro)
            pending = sel.pending is not None
            zero = pending and bool((sel.pending.counters[0] == 1).all())

            def step():
                s_ = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
                return K.attend(q, cache, ids, s_, alpha=alpha, scale=scale, slopes=slopes)[0]

            g, go = capture(step)
            bad = 0
            for _ in range(replays):
                g.replay()
                bad += int(not torch.equal(go, eo))
            torch.cuda.synchronize()
            report(f"rowsel top-k a{alpha} {tag}", pending and zero and same and e < TOL[dtype] and bad == 0,
                   f"pending {pending} rows published {zero} sets {same} rel {e:.1e} "
                   f"replays differing {bad}/{replays}")
            del g


def check_dense_one_head(K, report, dims):
    """The dense one-head entmax pass (software-pipelined, its tile set by row
    count: attention.DENSE_ENTMAX_PIPE) over every dtype and head dim, with
    fewer rows than multiprocessors and with more (its two plans)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for dtype, D in itertools.product([torch.float16, torch.bfloat16, torch.float32], dims):
        for H, lens in ((2, [2500, 700, 19]), (-(-sms // 3) + 1, [1200, 333, 16])):
            cache, ids, q = make(lens, H, 1, D, 16, dtype, seed=D + H)
            scale = 1.0 / math.sqrt(D)
            for alpha in (1.5, 2.0):
                check_dense(K, report, f"dense one-head a{alpha} {str(dtype)[6:]} D{D} rows {len(lens) * H}",
                            q, cache, ids, alpha, scale, None)
            del cache


def check_finish(K, report, dims):
    """The ways an entmax head finishes, on nearly flat keys (long candidate
    lists, a support of most kept tokens): _finish_kernel solving in
    registers where a row's lists fit, from memory where they do not
    (attention.SOLVE_TILE shrunk: every list outgrows the tile), and the
    three launches (attention.FINISH off); dense with one head per program
    and more rows than multiprocessors (two splits) and on the tl.dot path
    (G = 4), and over a top-k 1024 selection, whose support spans several V
    blocks."""
    from entmaxkv.kernels import attention as A

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {"registers": {}, "memory": {"SOLVE_TILE": 64}, "three launches": {"FINISH": False}}
    for dtype, D in itertools.product([torch.float16, torch.bfloat16, torch.float32], [d for d in dims if d in (32, 128)]):
        for H, G, lens in ((-(-sms // 3) + 1, 1, [1200, 333, 16]), (2, 4, [3000, 700, 19])):
            cache, ids, q = make(lens, H, G, D, 16, dtype, seed=D + G, key_scale=0.01)
            scale = 1.0 / math.sqrt(D)
            for vname, knobs in variants.items():
                saved = {k: getattr(A, k) for k in knobs}
                try:
                    for k, v in knobs.items():
                        setattr(A, k, v)
                    for alpha in (1.5, 2.0):
                        tag = f"{vname} a{alpha} {str(dtype)[6:]} D{D} H{H}G{G}"
                        check_dense(K, report, f"finish dense {tag}", q, cache, ids, alpha, scale, None)
                        pol = RP.TopK(1024)
                        sel = K.select(pol, q, cache, ids, alpha=alpha, scale=scale)
                        o, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=scale)
                        ro, rtau = RA.attend(q.double(), cache, ids, sel, alpha=alpha, scale=scale)
                        e, te = rel(o, ro), float((tau.double() - rtau).abs().max())
                        report(f"finish topk1024 {tag}", e < TOL[dtype] and te < 1e-4, f"rel {e:.1e} tau {te:.1e}")
                finally:
                    for k, v in saved.items():
                        setattr(A, k, v)
            del cache


def run_case(case_i, dtype, D, H, G, P, K, report):
    if True:
        lens = [3000 + 17 * case_i, 1537, P + 3]
        cache, ids, q = make(lens, H, G, D, P, dtype, seed=case_i)
        scale = 1.0 / math.sqrt(D)
        slopes = None
        if case_i % 2 == 1:
            slopes = alibi(H * G)
            slopes[(H * G) // 2:] = 0.0
        tag = f"{str(dtype)[6:]} D{D} H{H}G{G} P{P}{' alibi' if slopes is not None else ''}"
        q64 = q.double()
        # -- scoring
        ub = K.quest_bounds(q, cache, ids, scale=scale, slopes=slopes)
        rub = RS.quest_bounds(q, cache, ids, scale=scale, slopes=slopes)
        fin = torch.isfinite(rub)
        ok = bool((torch.isfinite(ub) == fin).all()) and rel(ub[fin], rub[fin]) < 1e-5
        report(f"quest_bounds  {tag}", ok, f"rel {rel(ub[fin], rub[fin]):.1e}")
        mu, sg, nt = K.gaussian_stats(q, cache, ids, scale=scale, slopes=slopes)
        rmu, rsg, rnt = RS.gaussian_stats(q, cache, ids, scale=scale, slopes=slopes)
        e = max(rel(mu, rmu), rel(sg, rsg), rel(nt, rnt))
        report(f"gaussian_stats {tag}", e < 1e-5, f"rel {e:.1e}")
        # -- attention, dense and sparse, several alphas
        for alpha in (1.0, 1.5, 2.0, 1.25):
            check_dense(K, report, f"dense a{alpha} {tag}", q, cache, ids, alpha, scale, slopes)
            for pol in (RP.TopK(256), RP.TopK(128, sinks=1, window=2, per_query_head=True)):
                sel = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
                rsel = RP.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
                same = sets(sel) == sets(rsel)
                o, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=scale, slopes=slopes)
                ro, rtau = RA.attend(q64, cache, ids, rsel, alpha=alpha, scale=scale, slopes=slopes)
                e, te = rel(o, ro), float((tau.double() - rtau).abs().max())
                report(f"topk{pol.budget}{'q' if pol.per_query_head else ''} a{alpha} {tag}",
                       same and e < TOL[dtype] and te < 1e-4, f"sets {same} rel {e:.1e} tau {te:.1e}")
        for alpha in (1.5, 2.0):
            pols = [RP.Certified(seed=RP.TopK(128))]
            if hasattr(K, "select") and _has_gaussian():
                pols += [RP.Gaussian(), RP.Gaussian(pooled=True, margin=0.1), RP.Certified(seed=RP.Gaussian())]
            for pol in pols:
                name = f"{pol.name}{'/' + pol.seed.name if isinstance(pol, RP.Certified) else ''}"
                try:
                    sel = K.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
                    rsel = RP.select(pol, q, cache, ids, alpha=alpha, scale=scale, slopes=slopes)
                    s1, s2 = sets(sel), sets(rsel)
                    diff = sum(len(a ^ b) for ra, rb in zip(s1, s2) for a, b in zip(ra, rb))
                    o, tau = K.attend(q, cache, ids, sel, alpha=alpha, scale=scale, slopes=slopes,
                                      tau_init=sel.tau_hat)
                    ro, rtau = RA.attend(q64, cache, ids, rsel, alpha=alpha, scale=scale, slopes=slopes)
                    e = rel(o, ro)
                    th = ""
                    ok = diff <= 2 and e < max(TOL[dtype], 1e-3 if diff else 0)
                    if sel.tau_hat is not None:
                        # against a float64 solve (the float32 reference loses digits in
                        # the Gaussian tail, e.g. pooled rows under ALiBi)
                        oracle = tau_hat_f64(pol, q, cache, ids, scale, slopes, alpha)
                        te = float((sel.tau_hat.double() - oracle).abs().max())
                        tr = float((rsel.tau_hat.double() - oracle).abs().max())
                        th = f" tau_hat {te:.1e} (float32 reference {tr:.1e})"
                        ok = ok and te < 1e-3
                    report(f"{name} a{alpha} {tag}", ok, f"page diff {diff} rel {e:.1e}{th}")
                except Exception as exc:
                    report(f"{name} a{alpha} {tag}", False, f"{type(exc).__name__}: {exc}")
        # -- certify
        sel = K.select(RP.TopK(256), q, cache, ids, alpha=1.5, scale=scale, slopes=slopes)
        o, tau = K.attend(q, cache, ids, sel, alpha=1.5, scale=scale, slopes=slopes)
        lay = RS.page_layout(cache, ids)
        slack = RS.bound_slack(q, cache, ids, scale=scale, slopes=slopes)
        c = K.certify(ub, sel, tau, 1.5, lay.seq_len, page_size=P, slack=slack)
        rc = RA.certify(ub, sel, tau, 1.5, lay.seq_len, page_size=P, slack=slack)
        report(f"certify {tag}", bool((c == rc).all()), f"{int(c.sum())}/{c.numel()} certified")
        # -- CUDA graph of a whole step equals the eager step
        if case_i % 3 == 0:
            pol = RP.TopK(256)

            def step():
                s_ = K.select(pol, q, cache, ids, alpha=1.5, scale=scale, slopes=slopes)
                return K.attend(q, cache, ids, s_, alpha=1.5, scale=scale, slopes=slopes)

            eo, _ = step()
            g, (go, _) = capture(step)
            g.replay()
            torch.cuda.synchronize()
            report(f"cuda graph {tag}", bool(torch.equal(go, eo)), "replay == eager")
        del cache


def tau_hat_f64(pol, q, cache, ids, scale, slopes, alpha):
    from entmaxkv.gaussian import pooled_moments, solve_tau_hat

    sl = None if slopes is None else slopes.double()
    mu, sg, n = RS.gaussian_stats(q.double(), cache, ids, scale=scale, slopes=sl)
    w = n[:, None, :].expand_as(mu)
    if pol.pooled:
        a, b, c = pooled_moments(mu, sg, w)
        return solve_tau_hat(a[..., None], b[..., None], c[..., None], alpha, iters=120)
    return solve_tau_hat(mu, sg, w, alpha, iters=120)


def _has_gaussian() -> bool:
    """The reference Gaussian solver exists (entmaxkv/gaussian.py)."""
    try:
        from entmaxkv.gaussian import solve_tau_hat

        return callable(solve_tau_hat)
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
