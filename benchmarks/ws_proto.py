"""Can a top-k step's row chains hide under its metadata read? (a proxy; a script, not a test; GPU only)

    PYTHONPATH=.:benchmarks python3 benchmarks/ws_proto.py --configs paper_128k

A proxy for the one route left to top-k at paper 8 x 128k (docs/kernels.md,
"Where the Triton route ends"). It moves the bytes of a Quest top-k 1024 step
(every page's metadata, then the K and V runs of 64 pages per selection row)
with the step's dependent round trips, but none of its arithmetic: nothing
here is the real selection or attention.

* Producers read the page metadata of (batch row, 64-page item) items in
  batch order through the benchmark's shuffled block table (a per-page
  maximum stands in for the bound's dot products) and raise a counter per
  batch row.
* A chain (one per selection row, i.e. batch row and head) waits for its
  batch row's counter, then: the group maxima of the row's 8192-key table,
  ROUNDS bisection steps over them (dependent cross-warp reductions), a
  second read of 64 groups' keys, then the K and V runs of 64 pages of its
  head, SP pages per step. CHAIN 1 makes the library's round trips (maxima
  through L2 in four loads, a page-id load per step); CHAIN 2 fewer (the
  row's keys in one load, maxima in registers, every page id in one load).

Forms, all timed in one process (CUDA graphs, L2 flushed, median; every form
with counters zeroes them with one memset inside its graph):

* ``triton gather``: read_ceiling's best whole-page gather of the metadata;
* ``triton keys``: the library's keys pass (select_topk's launch);
* ``quest step``: the library's Quest top-k 1024 step;
* ``gluon read``: the producers' loop alone in Gluon, many short programs;
* ``ws <NCTA>x<PW>+<CW>w<REGS>[:options]``: Gluon, warp-specialised: one
  persistent program per multiprocessor whose default partition (PW warps)
  produces items pid, pid + NCTA, ... while a worker partition (CW warps,
  REGS registers per thread) runs the chains of rows pid, pid + NCTA, ...;
  "idle": the worker returns at once;
* ``triton one launch LAG:BM:RUNW:WARPS:SP``: plain Triton, both roles in one
  launch of many short programs, the grid interleaved (batch row b's items,
  then the chains of row b - LAG; blocks are dispatched in order, so every
  chain's producers are resident or done before it polls).

Each line prints microseconds and its ratio to the top-k 1024 step's bytes
floor (bench_decode's count). Then, per persistent or one-launch form, a
%globaltimer timeline of one eager run after an L2 flush: when the producers
ended, per batch row when its chains began and when the last ended, the
range of the chains' lengths, and the kernel's registers and spills.
Results: results/ws_proto.log.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _now():
    """The GPU's global nanosecond timer."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [gl.program_id(0)], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _wait_row(cnt_ptr, b, target, err_ptr, POLLS: gl.constexpr):
    """Wait until the int32 counter cnt[b] reaches target (volatile loads, then
    one acquire). Bounded: after POLLS loads it gives up and counts one at
    err[0], so a grid that is not all resident ends instead of hanging."""
    c = gl.load(cnt_ptr + b, volatile=True)
    n_poll = 0
    while (c < target) & (n_poll < POLLS):
        c = gl.load(cnt_ptr + b, volatile=True)
        n_poll += 1
    c = gl.atomic_add(cnt_ptr + b, 0, sem="acquire", scope="gpu")
    if c < target:
        gl.atomic_add(err_ptr, 1)


def parse_form(v: str, sms: int, defaults) -> tuple:
    """A form ``[NCTAx]PW+CWwREGS[:<letter><int>]...`` -> (programs, producer
    warps, worker warps, worker registers, options): NCTA may be "sms" and
    defaults to one program per SM; ``defaults(pw, cw)`` gives the options'
    defaults, which the ``:<letter><int>`` items override."""
    head, *opts = v.split(":")
    ncta, head = head.split("x") if "x" in head else ("sms", head)
    pw, rest = head.split("+")
    cw, regs = rest.split("w")
    ncta, pw, cw, regs = (sms if ncta == "sms" else int(ncta)), int(pw), int(cw), int(regs)
    o = defaults(pw, cw)
    o.update({x[0]: int(x[1:]) for x in opts})
    return ncta, pw, cw, regs, o


def timeline(fn, flush: torch.Tensor, producer_stamps) -> tuple:
    """Run ``fn`` three times, each after an L2 flush, and read the last
    run's %globaltimer stamps: ``producer_stamps()`` gives int64 [programs,
    2] (start, end). Returns (t0, ends): the first producer's start (ns,
    float64) and every producer's end in us after it."""
    for _ in range(3):
        flush.zero_()
        fn()
    torch.cuda.synchronize()
    t = producer_stamps().double()
    t0 = t[:, 0].min()
    return t0, (t[:, 1] - t0) / 1e3


def graph_us(fn, flush: torch.Tensor, reps: int) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph, L2 flushed
    before each replay (bench_decode's capture / time_graph)."""
    from bench_decode import capture, time_graph

    g, _ = capture(fn)
    ms, _ = time_graph(g, flush, 5, reps, warm_ms=50)
    return ms * 1e3


@gluon.jit
def _read_item(bt_ptr, meta_ptr, it, NPG: gl.constexpr, BM: gl.constexpr, E: gl.constexpr, W: gl.constexpr,
               RUNW: gl.constexpr):
    """Largest metadata value of item ``it``'s NPG pages (E halfs each): BM
    pages per step, in runs of RUNW halfs (512: three runs of a page, one per
    step; 2048: the whole page in one run, masked past E)."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [W, 1], [1, 0])
    NR: gl.constexpr = (E + RUNW - 1) // RUNW
    acc = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, lay))
    o_b = gl.arange(0, BM, layout=gl.SliceLayout(1, lay))
    o_r = gl.arange(0, RUNW, layout=gl.SliceLayout(0, lay))
    for s in range((NPG // BM) * NR):
        o_m = it * NPG + (s // NR) * BM + o_b
        phys = gl.load(bt_ptr + o_m).to(gl.int64)
        o_e = (s % NR) * RUNW + o_r
        off = phys[:, None] * E + o_e[None, :]
        x = gl.load(meta_ptr + off, mask=(o_e < E)[None, :], other=float("-inf")).to(gl.float32)
        acc = gl.maximum(acc, gl.max(x, axis=1))  # a per-page value, as the keys pass's dot products
    return gl.max(acc, axis=0)


@gluon.jit
def _gluon_read(bt_ptr, meta_ptr, out_ptr, NPG: gl.constexpr, BM: gl.constexpr, E: gl.constexpr, W: gl.constexpr,
                RUNW: gl.constexpr):
    it = gl.program_id(0)
    gl.store(out_ptr + it, _read_item(bt_ptr, meta_ptr, it, NPG, BM, E, W, RUNW))


@gluon.jit
def _producer(bt_ptr, meta_ptr, out_ptr, cnt_ptr, ts_ptr, NITEMS, IPB, NPG: gl.constexpr, BM: gl.constexpr,
              E: gl.constexpr, PW: gl.constexpr, RUNW: gl.constexpr):
    """Items pid, pid + NCTA, ... (batch order); stamps ts[2 pid] / ts[2 pid + 1]: start / end."""
    pid = gl.program_id(0)
    ncta = gl.num_programs(0)
    gl.store(ts_ptr + 2 * pid, _now())
    for it in range(pid, NITEMS, ncta):
        gl.store(out_ptr + it, _read_item(bt_ptr, meta_ptr, it, NPG, BM, E, PW, RUNW))
        # no barrier before the release: the stand-in chains read nothing the producers store
        # (ws_quest.py's producers, whose keys are read, do synchronise first)
        gl.atomic_add(cnt_ptr + it // IPB, 1, sem="release", scope="gpu")
    gl.store(ts_ptr + 2 * pid + 1, _now())


@gluon.jit
def _consumer(bt_ptr, key_ptr, gm_ptr, kp_ptr, vp_ptr, res_ptr, cnt_ptr, err_ptr, tr_ptr, NROWS, H, M, IPB,
              CW: gl.constexpr, CHAIN: gl.constexpr, POLLS: gl.constexpr, SP: gl.constexpr, ROUNDS: gl.constexpr):
    """Stand-in chains of the selection rows r = pid, pid + NCTA, ... (see the
    module docstring): ROUNDS search rounds, the K/V of 64 pages SP per step;
    stamps tr[2 r] / tr[2 r + 1]: row ready / chain done. CHAIN 1: the
    library's round trips (group maxima through L2 in four loads, a page-id
    load per K/V step); CHAIN 2: fewer (the row's keys in one load and its
    maxima in registers, every page id in one load)."""
    if CHAIN:
        pid = gl.program_id(0)
        ncta = gl.num_programs(0)
        lg: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [CW, 1], [1, 0])  # [groups, 16 keys]
        l1: gl.constexpr = gl.BlockedLayout([4], [32], [CW], [0])  # [512] group maxima
        lkv: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [CW, 1], [1, 0])  # [SP pages, 512 halfs]
        o_g = gl.arange(0, 128, layout=gl.SliceLayout(1, lg))
        o_k = gl.arange(0, 16, layout=gl.SliceLayout(0, lg))
        o_1 = gl.arange(0, 512, layout=l1)
        o_p = gl.arange(0, SP, layout=gl.SliceLayout(1, lkv))
        o_e = gl.arange(0, 512, layout=gl.SliceLayout(0, lkv))
        lg2: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [CW, 1], [1, 0])  # [512 groups, 16 keys]
        o_g2 = gl.arange(0, 512, layout=gl.SliceLayout(1, lg2))
        o_k2 = gl.arange(0, 16, layout=gl.SliceLayout(0, lg2))
        lpg: gl.constexpr = gl.BlockedLayout([64 // SP, 1], [1, 32], [1, CW], [1, 0])  # [steps, SP pages]
        o_t = gl.arange(0, 64 // SP, layout=gl.SliceLayout(1, lpg))
        o_q = gl.arange(0, SP, layout=gl.SliceLayout(0, lpg))
        for r in range(pid, NROWS, ncta):
            b = r // H
            h = r % H
            _wait_row(cnt_ptr, b, IPB, err_ptr, POLLS)
            gl.store(tr_ptr + 2 * r, _now())
            row = key_ptr + r.to(gl.int64) * 8192
            if CHAIN == 2:  # group maxima of 512 groups of 16 keys: one load, kept in registers
                kk = gl.load(row + o_g2[:, None] * 16 + o_k2[None, :])
                gm = gl.max(kk, axis=1)
            else:  # four loads, through L2 as the library's chain does
                for t in range(4):
                    kk = gl.load(row + (t * 128 + o_g)[:, None] * 16 + o_k[None, :])
                    gl.store(gm_ptr + r.to(gl.int64) * 512 + t * 128 + o_g, gl.max(kk, axis=1))
                gm = gl.load(gm_ptr + r.to(gl.int64) * 512 + o_1, volatile=True)
            # the 64th largest maximum, by ROUNDS bisection steps (dependent cross-warp reductions; the
            # library's search takes ~5-8 rounds of 4 thresholds)
            lo = gl.min(gm, axis=0)
            hi = gl.max(gm, axis=0)
            for _ in range(ROUNDS):
                mid = lo + (hi - lo + 1) // 2
                ge = gl.sum((gm >= mid).to(gl.int32), axis=0) >= 64
                lo = gl.where(ge, mid, lo)
                hi = gl.where(ge, hi, mid - 1)
            # a second read: 64 groups' keys (which ones depends on lo, as the real list does)
            g2 = (o_g % 64) * 8 + (lo & 7)
            kk = gl.load(row + g2[:, None] * 16 + o_k[None, :])
            thr = gl.max(gl.max(kk, axis=1), axis=0)
            # 64 pages of this head: their K and V runs (P x D = 512 halfs), a stand-in product
            acc = gl.zeros([SP, 512], gl.float32, lkv)
            if CHAIN == 2:  # every page id in one load, then K and V of SP pages per step
                pg2 = (o_t[:, None] * 8209 + o_q[None, :] * 1031 + r * 131 + (thr & 1)) % M
                ph2 = gl.load(bt_ptr + b.to(gl.int64) * M + pg2).to(gl.int64)  # [64 // SP, SP]
            for t in range(64 // SP):
                if CHAIN == 2:
                    phys = gl.convert_layout(gl.sum(gl.where((o_t == t)[:, None], ph2, 0), axis=0),
                                             gl.SliceLayout(1, lkv))
                else:
                    pg = (o_p * 1031 + t * 8209 + r * 131 + (thr & 1)) % M
                    phys = gl.load(bt_ptr + b.to(gl.int64) * M + pg).to(gl.int64)
                off = (phys * H + h)[:, None] * 512 + o_e[None, :]
                k = gl.load(kp_ptr + off).to(gl.float32)
                v = gl.load(vp_ptr + off).to(gl.float32)
                s = gl.sum(k, axis=1)
                acc += v * s[:, None]
            gl.store(res_ptr + r, gl.sum(gl.sum(acc, axis=1), axis=0))
            gl.store(tr_ptr + 2 * r + 1, _now())


@gluon.jit
def _ws_kernel(bt_ptr, meta_ptr, out_ptr, cnt_ptr, key_ptr, gm_ptr, kp_ptr, vp_ptr, res_ptr, err_ptr, ts_ptr, tr_ptr,
               NITEMS, IPB, NROWS, H, M,
               NPG: gl.constexpr, BM: gl.constexpr, E: gl.constexpr, PW: gl.constexpr, CW: gl.constexpr,
               REGS: gl.constexpr, CHAIN: gl.constexpr, RUNW: gl.constexpr, SP: gl.constexpr, ROUNDS: gl.constexpr):
    gl.warp_specialize([
        (_producer, (bt_ptr, meta_ptr, out_ptr, cnt_ptr, ts_ptr, NITEMS, IPB, NPG, BM, E, PW, RUNW)),
        (_consumer, (bt_ptr, key_ptr, gm_ptr, kp_ptr, vp_ptr, res_ptr, cnt_ptr, err_ptr, tr_ptr, NROWS, H, M, IPB,
                     CW, CHAIN, 1 << 22, SP, ROUNDS)),
    ], [CW], [REGS])

# ---------------------------------------------------------------------------
# the same roles in plain Triton: one launch, no warp specialisation, the
# roles interleaved in the grid (the items of batch row b, then the chains of
# row b - LAG; blocks of a 1-D grid are dispatched in order, so a chain's
# producers have all been dispatched before it and its poll always ends)
# ---------------------------------------------------------------------------


@triton.jit
def _t_now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.program_id(0)], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _t_one_launch(role_ptr, bt_ptr, meta_ptr, out_ptr, cnt_ptr, key_ptr, kp_ptr, vp_ptr, res_ptr, err_ptr, ts_ptr,
                  tr_ptr, IPB, H, M, NPG: tl.constexpr, BM: tl.constexpr, E: tl.constexpr, RUNW: tl.constexpr,
                  SP: tl.constexpr, ROUNDS: tl.constexpr, POLLS: tl.constexpr, CHAIN: tl.constexpr):
    """role[pid] >= 0: that producer item (NPG pages of metadata, BM per
    step, runs of RUNW halfs); < 0: the stand-in chain (CHAIN 2's round trips)
    of selection row -role - 1."""
    pid = tl.program_id(0)
    role = tl.load(role_ptr + pid)
    if role >= 0:
        tl.store(ts_ptr + 2 * pid, _t_now())
        NR: tl.constexpr = (E + RUNW - 1) // RUNW
        acc = tl.full([BM], float("-inf"), tl.float32)
        o_b = tl.arange(0, BM)
        o_r = tl.arange(0, RUNW)
        for s in range((NPG // BM) * NR):
            o_m = role * NPG + (s // NR) * BM + o_b
            phys = tl.load(bt_ptr + o_m).to(tl.int64)
            o_e = (s % NR) * RUNW + o_r
            x = tl.load(meta_ptr + phys[:, None] * E + o_e[None, :], mask=(o_e < E)[None, :], other=float("-inf"))
            acc = tl.maximum(acc, tl.max(x.to(tl.float32), axis=1))
        tl.store(out_ptr + role, tl.max(acc, axis=0))
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + role // IPB, 1, sem="release", scope="gpu")
        tl.store(ts_ptr + 2 * pid + 1, _t_now())
    elif CHAIN:
        r = -role - 1
        b = r // H
        h = r % H
        c = tl.load(cnt_ptr + b, volatile=True)
        n_poll = 0
        while (c < IPB) & (n_poll < POLLS):
            c = tl.load(cnt_ptr + b, volatile=True)
            n_poll += 1
        c = tl.atomic_add(cnt_ptr + b, 0, sem="acquire", scope="gpu")
        if c < IPB:
            tl.atomic_add(err_ptr, 1)
        tl.store(tr_ptr + 2 * r, _t_now())
        row = key_ptr + r.to(tl.int64) * 8192
        o_g = tl.arange(0, 512)
        o_k = tl.arange(0, 16)
        gm = tl.max(tl.load(row + o_g[:, None] * 16 + o_k[None, :]), axis=1)
        lo = tl.min(gm, axis=0)
        hi = tl.max(gm, axis=0)
        for _ in range(ROUNDS):
            mid = lo + (hi - lo + 1) // 2
            ge = tl.sum((gm >= mid).to(tl.int32), axis=0) >= 64
            lo = tl.where(ge, mid, lo)
            hi = tl.where(ge, hi, mid - 1)
        o_64 = tl.arange(0, 64)
        g2 = (o_64 % 64) * 8 + (lo & 7)
        thr = tl.max(tl.max(tl.load(row + g2[:, None] * 16 + o_k[None, :]), axis=1), axis=0)
        NS: tl.constexpr = 64 // SP
        o_t = tl.arange(0, NS)
        o_q = tl.arange(0, SP)
        ph2 = tl.load(bt_ptr + b.to(tl.int64) * M
                      + (o_t[:, None] * 8209 + o_q[None, :] * 1031 + r * 131 + (thr & 1)) % M).to(tl.int64)
        o_d = tl.arange(0, 512)
        kv_acc = tl.zeros([SP, 512], tl.float32)
        for t in range(NS):
            ph = tl.sum(tl.where((o_t == t)[:, None], ph2, 0), axis=0)
            off = (ph * H + h)[:, None] * 512 + o_d[None, :]
            k = tl.load(kp_ptr + off).to(tl.float32)
            v = tl.load(vp_ptr + off).to(tl.float32)
            kv_acc += v * tl.sum(k, axis=1)[:, None]
        tl.store(res_ptr + r, tl.sum(tl.sum(kv_acc, axis=1), axis=0))
        tl.store(tr_ptr + 2 * r + 1, _t_now())


def one_launch_roles(B: int, IPB: int, H: int, lag: int, device) -> torch.Tensor:
    """int32 role per program: batch row b's IPB items (b * IPB + j), then the
    H chains (-(row + 1)) of batch row b - lag; the last lag rows' chains at
    the end."""
    roles = []
    for b in range(B + lag):
        if b < B:
            roles += range(b * IPB, (b + 1) * IPB)
        if b >= lag:
            roles += [-((b - lag) * H + h + 1) for h in range(H)]
    return torch.tensor(roles, dtype=torch.int32, device=device)


def main(argv=None):
    from bench_decode import CONFIGS, build, make_step
    from read_ceiling import _gather_kernel
    import entmaxkv.kernels as K
    from entmaxkv.kernels import topk as T
    from entmaxkv.kernels._common import as_slopes, num_sms

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="paper_128k")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="132x16+8w88:s16:c2:r2048:b16,132x16+8w56:s16:c2:r2048:b16",
                    help="persistent forms NCTAxPW+CWwREGS[:rRUNW][:bBM][:sSP][:nROUNDS][:cCHAIN] (defaults: runs "
                         "of 512 halfs, BM 32 pages per step at PW >= 8 else 16, SP = 2 CW pages per K/V step, 8 "
                         "rounds, chain form 1)")
    ap.add_argument("--reads", default="8:2048:8",
                    help="non-persistent Gluon reads BM:RUNW:WARPS")
    ap.add_argument("--npg", type=int, default=64, help="pages per producer item")
    ap.add_argument("--one-launch", default="1:8:2048:8:16,2:4:2048:4:16",
                    help="plain-Triton one-launch forms LAG:BM:RUNW:WARPS:SP")
    args = ap.parse_args(argv)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    sms = num_sms(torch.device("cuda"))
    print(f"# {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}")

    for cname in args.configs.split(","):
        cfg = CONFIGS[cname]
        B, n, HQ, H, D, dtype, P = cfg
        assert HQ == H and D == 32 and P == 16 and H % 8 == 0, "the proxy is written for the paper heads"
        cache, ids, q, k4, v4 = build(cfg)
        del k4, v4  # the contiguous copies: not read here
        M = cache.block_table.shape[1]
        meta = cache.k_bounds
        E = meta[0].numel()
        bt = cache.block_table[ids.long()].reshape(-1).contiguous()
        # bench_decode's top-k 1024 floor: metadata + K/V of 64 pages per row + outputs, at 4.26 TB/s
        floor_us = (B * M * E * 2 + 2 * B * H * 64 * P * D * 2 + B * HQ * D * 2) / 4.26e6
        NP = bt.numel()
        npg = args.npg
        NITEMS, IPB = NP // npg, M // npg
        NROWS = B * H
        keys = torch.randint(-2**30, 2**30, (NROWS * 8192,), dtype=torch.int32, device="cuda")
        gm = torch.empty(NROWS * 512, dtype=torch.int32, device="cuda")
        res = torch.empty(NROWS, dtype=torch.float32, device="cuda")
        out = torch.empty(NITEMS, dtype=torch.float32, device="cuda")
        cnt = torch.zeros(B, dtype=torch.int32, device="cuda")
        err = torch.zeros(1, dtype=torch.int32, device="cuda")  # polls that gave up (must stay 0)
        ts = torch.zeros(2 * 4 * sms, dtype=torch.int64, device="cuda")  # producer start / end per program
        tr = torch.zeros(2 * NROWS, dtype=torch.int64, device="cuda")  # row ready / chain done
        tsl = torch.zeros(2 * (NITEMS + NROWS), dtype=torch.int64, device="cuda")  # one-launch programs' stamps
        want = meta.view(-1, E)[bt.long()].view(NITEMS, npg * E).amax(1).float()  # each item's largest value
        scale = D ** -0.5

        lines = {}
        gout = torch.empty(triton.cdiv(NP, 8), device="cuda")
        lines["triton gather (run 2048 x 4 pages x 2, 8 w)"] = lambda: _gather_kernel[(gout.numel(),)](
            bt, meta, meta, gout, NP, E=E, RUN=2048, BLOCK_M=4, NSUB=2, num_warps=8)
        k_pages, W = T.topk_width(M, P, 1024, 0, 0)
        tcfg = T.topk_plan(M, W, 1, D, q.dtype, cache.dtype, B * H, sms, cap=T.SELECT_CH)
        MK = tcfg["NCH"] * tcfg["CH"]
        tkeys = torch.empty(B * H * MK, dtype=torch.int32, device="cuda")
        sl = as_slopes(None, HQ, q.device)
        lines["triton keys (select_topk's keys pass)"] = lambda: T.launch_keys(
            q, sl, ids, cache, tkeys, None, MK, scale, 0, 0, k_pages, has_alibi=False)
        lines["quest step (library, top-k 1024)"] = make_step(K, "quest_topk1024", cache, ids, q, None, None, scale)
        for rd in args.reads.split(","):
            bm, runw, w = (int(x) for x in rd.split(":"))
            lines[f"gluon read ({npg}-page items, {bm} x {runw} tiles, {w} w)"] = (
                lambda bm=bm, runw=runw, w=w: _gluon_read[(NITEMS,)](bt, meta, out, NPG=npg, BM=bm, E=E, W=w,
                                                                    RUNW=runw, num_warps=w))
        timelines, compiled = {}, {}
        for ol in filter(None, args.one_launch.split(",")):
            lag, bm, runw, w, sp = (int(x) for x in ol.split(":"))
            roles = one_launch_roles(B, IPB, H, lag, "cuda")
            for chain in (0, 1):
                name = f"triton one launch {ol} {'chains' if chain else 'idle'}"

                def one(roles=roles, bm=bm, runw=runw, w=w, sp=sp, chain=chain, name=name):
                    cnt.zero_()
                    compiled[name] = _t_one_launch[(roles.numel(),)](
                        roles, bt, meta, out, cnt, keys, cache.k_pages, cache.v_pages, res, err, tsl, tr, IPB, H, M,
                        NPG=npg, BM=bm, E=E, RUNW=runw, SP=sp, ROUNDS=8, POLLS=1 << 22, CHAIN=chain, num_warps=w)
                lines[name] = one
                # the producer programs' stamps (the chains' slots stay 0)
                timelines[name] = (one, lambda: tsl.view(-1, 2)[tsl.view(-1, 2)[:, 0] > 0], chain)
        for v in args.variants.split(","):
            ncta, pw, cw, regs, o = parse_form(
                v, sms, lambda pw, cw: dict(r=512, b=32 if pw >= 8 else 16, s=2 * cw, n=8, c=1))
            for chain in (0, o["c"]):
                name = f"ws {v} {'chains' if chain else 'idle'}"

                def ws(ncta=ncta, pw=pw, cw=cw, regs=regs, chain=chain, o=o, name=name):
                    cnt.zero_()
                    compiled[name] = _ws_kernel[(ncta,)](
                        bt, meta, out, cnt, keys, gm, cache.k_pages, cache.v_pages, res, err, ts, tr,
                        NITEMS, IPB, NROWS, H, M, NPG=npg, BM=o["b"], E=E, PW=pw, CW=cw, REGS=regs,
                        CHAIN=chain, RUNW=o["r"], SP=o["s"], ROUNDS=o["n"], num_warps=pw)
                lines[name] = ws
                timelines[name] = (ws, lambda ncta=ncta: ts[:2 * ncta].view(ncta, 2), chain)
        print(f"## {cname}: floor {floor_us:.1f} us (1.5x: {1.5 * floor_us:.1f}), metadata "
              f"{NP * E * 2 / 1e6:.1f} MB, {NITEMS} items of {npg} pages, {NROWS} rows", flush=True)
        for rnd in range(args.rounds):
            for name, fn in lines.items():
                try:
                    us = graph_us(fn, flush, args.reps)
                except Exception as exc:  # a variant that does not compile or launch: say so, go on
                    print(f"{cname} r{rnd} {name:48s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                          flush=True)
                    continue
                note = ""
                if name.startswith(("gluon", "ws", "triton one")):  # the producer's maxima, and no poll gave up
                    note = f"  items {'ok' if torch.equal(out, want) else 'WRONG'}, gave up {int(err)}"
                    out.zero_()
                print(f"{cname} r{rnd} {name:48s} {us:8.1f} us  {us / floor_us:5.2f}x floor{note}", flush=True)
        # timelines: one eager run after an L2 flush per persistent form, us from the first producer's start
        for name, (fn, stamps, chain) in timelines.items():
            ts.zero_()
            tsl.zero_()
            tr.zero_()
            t0, end = timeline(fn, flush, stamps)
            line = (f"{cname} timeline {name:40s} producers end {end.min():6.1f}-{end.max():6.1f} us")
            if chain:
                rt = ((tr.view(B, H, 2).double() - t0) / 1e3)
                ready, done = rt[..., 0], rt[..., 1]
                line += "; batch rows ready / done: " + " ".join(
                    f"{ready[b].min():.0f}-{ready[b].max():.0f}/{done[b].max():.0f}" for b in range(B))
                chain_us = (done - ready).flatten()
                line += f"; chain {chain_us.min():.1f}-{chain_us.max():.1f} us"
            k = compiled.get(name)
            if k is not None:
                line += f" [{getattr(k, 'n_regs', '?')} registers, {getattr(k, 'n_spills', '?')} spills]"
            print(line, flush=True)
        cache = meta = lines = timelines = None  # free before the next configuration
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
