"""A warp-specialised Quest top-k step in Gluon, paper heads only (a prototype; a script, not a test; GPU only)

    PYTHONPATH=.:benchmarks python3 benchmarks/ws_quest.py --configs paper_128k

The step of ``ws_proto.py`` with the real arithmetic, for the one shape of
the misses where it was measured (docs/kernels.md, "Where the Triton route
ends"): 24 query = 24 KV heads, head dim 32, fp16, page 16, full rows, Quest
top-k 1024 (the last page forced, then the 63 pages of highest bound), no
ALiBi, sinks or window. Not a library kernel: Gluon cannot run under
TRITON_INTERPRET, so CI could not test it.

One persistent program per multiprocessor:

* producer warps (the default partition) take (batch row, 64-page item)
  items in batch order: each page's k_min / k_max of every head through the
  block table, the Quest bound q-·k_min + q+·k_max per head, its sortable
  key (the last page: the largest key) stored to a key table [B*H, M]; then
  a release that raises the batch row's counter;
* worker warps take the selection rows (batch row, head) pid, pid + NCTA, ...
  as their batch rows complete: the maxima of 512 groups of 16 keys, a lower
  bound lb on the 64th largest key (rounds of 8 thresholds over the maxima),
  the keys of the groups whose maximum reaches lb, the exact cut of the 64
  largest from below, the pages' K and V (16 pages per step), softmax
  attention, the output row.

Checked against the library's Quest step on the same cache (pages per row as
sets, outputs), then timed next to it (CUDA graphs, L2 flushed, median). Per
form it also prints the kernel's registers and spills and a %globaltimer
timeline of one run after an L2 flush (when the producers ended; per batch
row when its rows were ready, selected and done). Forms (``--variants``):
producer warps, worker warps and registers, and options: BM pages per
producer step, the search's rounds and thresholds, pages per attention step,
the producer form (1: every head slot of a page per step; 2: 8 heads per
step), the attention form (1: page ids loaded per step; 2: all first), s0
(the producers alone, the worker idle). Triton 3.6's Gluon has no ``barrier``
(it is ``thread_barrier``) and no ``cumsum``: the script takes either
barrier and scans with ``associative_scan``.
Results: results/ws_quest.log (exact; 2.5-2.7x of the floor as written).
"""
from __future__ import annotations

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ws_proto import _now, _wait_row, graph_us, parse_form, timeline

INT_MAX = gl.constexpr(2147483647)
# a barrier of the calling partition's warps: thread_barrier in Triton 3.6 (the H200), barrier in later releases
_sync = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def _sortable(x):
    """float32 -> int32 whose signed order is the float order."""
    b = x.to(gl.int32, bitcast=True)
    return gl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _cumsum(x, axis: gl.constexpr):
    """Inclusive prefix sum (Gluon in Triton 3.6 has no cumsum)."""
    return gl.associative_scan(x, axis, _add)


@gluon.jit
def _rank2(f, L1: gl.constexpr, LR: gl.constexpr):
    """Row-major inclusive prefix count minus one of a 2-D 0/1 int32 tile
    (its row sums in layout LR, scanned in the 1-D blocked layout L1: a scan
    over a sliced layout does not lower)."""
    rs = gl.convert_layout(gl.sum(f, axis=1), L1)
    before = gl.convert_layout(_cumsum(rs, axis=0) - rs, LR)
    return gl.expand_dims(before, 1) + _cumsum(f, axis=1) - 1


@gluon.jit
def _produce(q_ptr, bt_ptr, meta_ptr, key_ptr, cnt_ptr, ts_ptr, scale, M, NITEMS, IPB,
             H: gl.constexpr, D: gl.constexpr, NPG: gl.constexpr, BM: gl.constexpr, PW: gl.constexpr,
             PF: gl.constexpr):
    """Keys of items pid, pid + NCTA, ... (batch order), each then published
    by a release that raises its batch row's counter; ts[2 pid] / ts[2 pid +
    1]: this program's start / end (%globaltimer). PF 1: _keys_all; PF 2:
    _keys_hg."""
    pid = gl.program_id(0)
    ncta = gl.num_programs(0)
    gl.store(ts_ptr + 2 * pid, _now())
    for it in range(pid, NITEMS, ncta):
        b = it // IPB
        if PF == 2:
            _keys_hg(q_ptr, bt_ptr, meta_ptr, key_ptr, scale, M, b, it % IPB, H, D, NPG, BM, PW)
        else:
            _keys_all(q_ptr, bt_ptr, meta_ptr, key_ptr, scale, M, b, it % IPB, H, D, NPG, BM, PW)
        _sync()  # this partition's key stores, then one release
        gl.atomic_add(cnt_ptr + b, 1, sem="release", scope="gpu")
    gl.store(ts_ptr + 2 * pid + 1, _now())


@gluon.jit
def _keys_all(q_ptr, bt_ptr, meta_ptr, key_ptr, scale, M, b, c,
              H: gl.constexpr, D: gl.constexpr, NPG: gl.constexpr, BM: gl.constexpr, PW: gl.constexpr):
    """Keys of batch row b's item c (pages c * NPG + [0, NPG)): BM pages per
    step, every head of a page at once (32 head slots, H valid)."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [PW, 1, 1], [2, 1, 0])  # [pages, heads, 2 * D]
    LPH: gl.constexpr = gl.SliceLayout(2, L3)  # [pages, heads]
    LQ: gl.constexpr = gl.SliceLayout(0, L3)  # [heads, 2 * D]
    HP: gl.constexpr = 32  # head slots (H <= 32)
    o_b = gl.arange(0, BM, layout=gl.SliceLayout(1, LPH))
    o_h = gl.arange(0, HP, layout=gl.SliceLayout(0, LPH))
    o_hq = gl.arange(0, HP, layout=gl.SliceLayout(1, LQ))
    o_j = gl.arange(0, 2 * D, layout=gl.SliceLayout(0, LQ))
    m_hq = (o_hq < H)[:, None] & (o_j < 2 * D)[None, :]
    # offsets of one page's metadata [heads, (min | max) x D] within its row of H * 2 * D values
    o_in = gl.expand_dims(o_hq[:, None] * (2 * D) + o_j[None, :], 0)
    m_in = gl.expand_dims(m_hq, 0)
    # q split by sign: the min half multiplies q's negative part, the max half its positive part
    qv = gl.load(q_ptr + b * (H * D) + o_hq[:, None] * D + (o_j % D)[None, :], mask=m_hq, other=0.0)
    qv = qv.to(gl.float32)
    qs = gl.where((o_j < D)[None, :], gl.minimum(qv, 0.0), gl.maximum(qv, 0.0)) * scale
    for s in range(NPG // BM):
        o_m = c * NPG + s * BM + o_b  # logical pages of batch row b
        phys = gl.load(bt_ptr + b * M + o_m).to(gl.int64)
        p3 = gl.expand_dims(gl.expand_dims(phys, 1), 2)
        x = gl.load(meta_ptr + p3 * (H * 2 * D) + o_in, mask=m_in, other=0.0).to(gl.float32)
        u = gl.sum(x * gl.expand_dims(qs, 0), axis=2)  # [BM, HP] bounds
        key = gl.where((o_m == M - 1)[:, None], INT_MAX, _sortable(u))
        gl.store(key_ptr + (b * H + o_h[None, :]).to(gl.int64) * M + o_m[:, None], key,
                 mask=(o_h < H)[None, :] & (o_m < M)[:, None])


@gluon.jit
def _keys_hg(q_ptr, bt_ptr, meta_ptr, key_ptr, scale, M, b, c,
             H: gl.constexpr, D: gl.constexpr, NPG: gl.constexpr, BM: gl.constexpr, PW: gl.constexpr):
    """_keys_all over BM pages x 8 heads per step (H a multiple of 8: no
    masked head slots), the q split reloaded per step (L1 hits)."""
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [PW, 1, 1], [2, 1, 0])  # [pages, 8 heads, 2 * D]
    LPH: gl.constexpr = gl.SliceLayout(2, L3)
    LQ: gl.constexpr = gl.SliceLayout(0, L3)
    o_b = gl.arange(0, BM, layout=gl.SliceLayout(1, LPH))
    o_h = gl.arange(0, 8, layout=gl.SliceLayout(0, LPH))
    o_hq = gl.arange(0, 8, layout=gl.SliceLayout(1, LQ))
    o_j = gl.arange(0, 2 * D, layout=gl.SliceLayout(0, LQ))
    o_in = gl.expand_dims(o_hq[:, None] * (2 * D) + o_j[None, :], 0)
    for s in range(NPG // BM):
        o_m = c * NPG + s * BM + o_b
        phys = gl.load(bt_ptr + b * M + o_m).to(gl.int64)
        p3 = gl.expand_dims(gl.expand_dims(phys, 1), 2) * (H * 2 * D)
        for g in gl.static_range(H // 8):
            x = gl.load(meta_ptr + p3 + (g * 8 * 2 * D) + o_in).to(gl.float32)
            qv = gl.load(q_ptr + b * (H * D) + (g * 8 + o_hq)[:, None] * D + (o_j % D)[None, :]).to(gl.float32)
            qs = gl.where((o_j < D)[None, :], gl.minimum(qv, 0.0), gl.maximum(qv, 0.0)) * scale
            u = gl.sum(x * gl.expand_dims(qs, 0), axis=2)  # [BM, 8] bounds
            key = gl.where((o_m == M - 1)[:, None], INT_MAX, _sortable(u))
            gl.store(key_ptr + (b * H + g * 8 + o_h[None, :]).to(gl.int64) * M + o_m[:, None], key)


@gluon.jit
def _select_attend(q_ptr, bt_ptr, key_ptr, kp_ptr, vp_ptr, cnt_ptr, gl_ptr, pg_ptr, out_ptr, err_ptr, tr_ptr, scale,
                   M, NROWS, IPB, H: gl.constexpr, D: gl.constexpr, P: gl.constexpr, K: gl.constexpr,
                   CW: gl.constexpr, ONE_G: gl.constexpr, NT: gl.constexpr, ROUNDS: gl.constexpr,
                   POLLS: gl.constexpr, SEL: gl.constexpr, SPG: gl.constexpr, AF: gl.constexpr):
    """Selection and attention of rows pid, pid + NCTA, ... (see the module
    docstring; SEL 0: none, the producers alone); tr[3 r + 0 / 1 / 2]: the
    row ready / selected / done (%globaltimer)."""
    if SEL:
        _rows(q_ptr, bt_ptr, key_ptr, kp_ptr, vp_ptr, cnt_ptr, gl_ptr, pg_ptr, out_ptr, err_ptr, tr_ptr, scale,
              M, NROWS, IPB, H, D, P, K, CW, ONE_G, NT, ROUNDS, POLLS, SPG, AF)


@gluon.jit
def _rows(q_ptr, bt_ptr, key_ptr, kp_ptr, vp_ptr, cnt_ptr, gl_ptr, pg_ptr, out_ptr, err_ptr, tr_ptr, scale,
          M, NROWS, IPB, H: gl.constexpr, D: gl.constexpr, P: gl.constexpr, K: gl.constexpr,
          CW: gl.constexpr, ONE_G: gl.constexpr, NT: gl.constexpr, ROUNDS: gl.constexpr, POLLS: gl.constexpr,
          SPG: gl.constexpr, AF: gl.constexpr):
    GS: gl.constexpr = 16  # keys per group
    NG: gl.constexpr = 512  # groups per row (M = 8192 pages)
    LG: gl.constexpr = gl.BlockedLayout([1, GS], [32, 1], [CW, 1], [1, 0])  # [groups, GS keys]
    LT: gl.constexpr = gl.BlockedLayout([NT, 1], [1, 32], [1, CW], [1, 0])  # [thresholds, groups]
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [CW], [0])  # 1-D lists
    LA: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 8, 4], [CW, 1, 1], [2, 1, 0])  # [pages, tokens, D]
    LS: gl.constexpr = gl.SliceLayout(2, LA)  # [pages, tokens]
    LD: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, LA))  # [D]
    pid = gl.program_id(0)
    ncta = gl.num_programs(0)
    o_g = gl.arange(0, NG, layout=gl.SliceLayout(1, LG))
    o_k = gl.arange(0, GS, layout=gl.SliceLayout(0, LG))
    o_t = gl.arange(0, NT, layout=gl.SliceLayout(1, LT))
    o_1 = gl.arange(0, ONE_G, layout=gl.SliceLayout(1, LG))
    o_l = gl.arange(0, NG, layout=L1)
    o_p = gl.arange(0, SPG, layout=gl.SliceLayout(1, LS))
    o_tok = gl.arange(0, P, layout=gl.SliceLayout(0, LS))
    o_d = gl.arange(0, D, layout=LD)
    LP2: gl.constexpr = gl.BlockedLayout([K // SPG, 1], [1, 32], [1, CW], [1, 0])  # [steps, SPG pages]
    o_s2 = gl.arange(0, K // SPG, layout=gl.SliceLayout(1, LP2))
    o_q2 = gl.arange(0, SPG, layout=gl.SliceLayout(0, LP2))
    for r in range(pid, NROWS, ncta):
        b = r // H
        h = r % H
        _wait_row(cnt_ptr, b, IPB, err_ptr, POLLS)
        gl.store(tr_ptr + 3 * r, _now())
        _sync()
        row = key_ptr + r.to(gl.int64) * M
        # -- group maxima, and lb <= the K-th largest key (rounds of NT thresholds over the maxima)
        gm = gl.max(gl.load(row + o_g[:, None] * GS + o_k[None, :], cache_modifier=".cg"), axis=1)
        gmt = gl.convert_layout(gm, gl.SliceLayout(0, LT))
        lo = gl.min(gmt, axis=0).to(gl.int64)
        hi = gl.max(gl.where(gmt < INT_MAX, gmt, -INT_MAX - 1), axis=0).to(gl.int64)  # below the forced page
        for _ in range(ROUNDS):
            mid = lo + 1 + (o_t.to(gl.int64) * (hi - lo)) // NT
            cnt_ge = gl.sum((gmt[None, :] >= mid.to(gl.int32)[:, None]).to(gl.int32), axis=1)
            ge = cnt_ge >= K
            lo = gl.maximum(gl.max(gl.where(ge, mid, lo), axis=0), lo)
            hi = gl.minimum(gl.min(gl.where(ge, hi, mid - 1), axis=0), hi)
        lb = lo.to(gl.int32)  # count(maxima >= lb) >= K, so every key of the K largest is >= lb
        # -- the groups whose maximum reaches lb, listed, then their keys in one tile
        gml = gl.convert_layout(gm, L1)
        m_g = gml >= lb
        i_g = _cumsum(m_g.to(gl.int32), axis=0) - 1
        n_grp = gl.sum(m_g.to(gl.int32), axis=0)
        gl.store(gl_ptr + r * NG + i_g, o_l, mask=m_g)
        if n_grp > ONE_G:
            gl.atomic_add(err_ptr + 1, 1)  # more groups than the tile holds: this row's pages are not exact
        _sync()
        m_q = o_1 < n_grp
        g_q = gl.load(gl_ptr + r * NG + o_1, mask=m_q, other=0, cache_modifier=".cg")
        kq = gl.load(row + g_q[:, None] * GS + o_k[None, :], mask=m_q[:, None], other=-INT_MAX - 1,
                     cache_modifier=".cg")
        pq = g_q[:, None] * GS + o_k[None, :]
        # -- the cut from below: T rises to the next key while more than K keys are above it
        T = lb
        n_gt = gl.sum(gl.sum((kq > T).to(gl.int32), axis=1), axis=0)
        while n_gt > K:
            T = gl.min(gl.min(gl.where(kq > T, kq, INT_MAX), axis=1), axis=0)
            n_gt = gl.sum(gl.sum((kq > T).to(gl.int32), axis=1), axis=0)
        # keep the keys > T, then ties at T in tile order (row-major) until K are kept
        m_eq = (kq == T).to(gl.int32)
        r_eq = _rank2(m_eq, L1, gl.SliceLayout(1, LG))
        m_sel = (kq > T) | ((m_eq > 0) & (r_eq < K - n_gt))
        i_out = _rank2(m_sel.to(gl.int32), L1, gl.SliceLayout(1, LG))
        gl.store(pg_ptr + r * K + i_out, pq, mask=m_sel)
        gl.store(tr_ptr + 3 * r + 1, _now())
        _sync()
        # -- softmax attention over the K pages, SPG per step
        qv = gl.load(q_ptr + (b * H + h) * D + o_d).to(gl.float32) * scale
        q3 = gl.expand_dims(gl.expand_dims(qv, 0), 0)
        m_i = gl.max(gl.full([D], float("-inf"), gl.float32, LD), axis=0)
        l_i = gl.sum(gl.zeros([D], gl.float32, LD), axis=0)
        acc = gl.zeros([D], gl.float32, LD)
        if AF == 2:  # every page id and block-table entry in one round trip each, before the steps
            pg2 = gl.load(pg_ptr + r * K + o_s2[:, None] * SPG + o_q2[None, :], cache_modifier=".cg")
            ph2 = gl.load(bt_ptr + b * M + pg2).to(gl.int64)
        for t in range(K // SPG):
            if AF == 2:
                phys = gl.convert_layout(gl.sum(gl.where((o_s2 == t)[:, None], ph2, 0), axis=0),
                                         gl.SliceLayout(1, LS))
            else:
                pg = gl.load(pg_ptr + r * K + t * SPG + o_p, cache_modifier=".cg")
                phys = gl.load(bt_ptr + b * M + pg).to(gl.int64)
            off = ((phys * H + h) * (P * D))[:, None] + (o_tok * D)[None, :]
            off3 = gl.expand_dims(off, 2) + gl.expand_dims(gl.expand_dims(o_d, 0), 0)
            kt = gl.load(kp_ptr + off3).to(gl.float32)
            vt = gl.load(vp_ptr + off3).to(gl.float32)
            sc = gl.sum(kt * q3, axis=2)  # [SPG, P] scores
            m_new = gl.maximum(m_i, gl.max(gl.max(sc, axis=1), axis=0))
            p = gl.exp(sc - m_new)
            alpha = gl.exp(m_i - m_new)
            l_i = l_i * alpha + gl.sum(gl.sum(p, axis=1), axis=0)
            acc = acc * alpha + gl.sum(gl.sum(gl.expand_dims(p, 2) * vt, axis=0), axis=0)
            m_i = m_new
        gl.store(out_ptr + (b * H + h) * D + o_d, acc / l_i)
        gl.store(tr_ptr + 3 * r + 2, _now())


@gluon.jit
def _ws_quest(q_ptr, bt_ptr, meta_ptr, key_ptr, kp_ptr, vp_ptr, cnt_ptr, gl_ptr, pg_ptr, out_ptr, err_ptr,
              ts_ptr, tr_ptr, scale, M, NITEMS, IPB, NROWS, H: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
              K: gl.constexpr, NPG: gl.constexpr, BM: gl.constexpr, PW: gl.constexpr, CW: gl.constexpr,
              REGS: gl.constexpr, ONE_G: gl.constexpr, NT: gl.constexpr, ROUNDS: gl.constexpr, SEL: gl.constexpr,
              SPG: gl.constexpr, PF: gl.constexpr, AF: gl.constexpr):
    gl.warp_specialize([
        (_produce, (q_ptr, bt_ptr, meta_ptr, key_ptr, cnt_ptr, ts_ptr, scale, M, NITEMS, IPB, H, D, NPG, BM, PW,
                    PF)),
        (_select_attend, (q_ptr, bt_ptr, key_ptr, kp_ptr, vp_ptr, cnt_ptr, gl_ptr, pg_ptr, out_ptr, err_ptr, tr_ptr,
                          scale, M, NROWS, IPB, H, D, P, K, CW, ONE_G, NT, ROUNDS, 1 << 22, SEL, SPG, AF)),
    ], [CW], [REGS])


def main(argv=None):
    from bench_decode import CONFIGS, build, make_step
    import entmaxkv.kernels as KER
    from entmaxkv.kernels._common import num_sms

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="paper_128k")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="16+8w88,16+8w88:p2:f2:b32,16+8w88:s0",
                    help="[NCTAx]PW+CWwREGS[:bBM][:rROUNDS][:tNT][:aSPG][:pPF][:fAF][:s0]: producer warps, worker "
                         "warps, worker registers, producer pages per step, search rounds and thresholds, "
                         "attention pages per step, producer form (1: all heads per step, 2: 8 heads per step), "
                         "attention form (1: page ids per step, 2: all first) (s0: producers alone); NCTA: programs "
                         "(default one per SM)")
    args = ap.parse_args(argv)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    sms = num_sms(torch.device("cuda"))
    print(f"# {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}")
    for cname in args.configs.split(","):
        cfg = CONFIGS[cname]
        B, n, HQ, H, D, dtype, P = cfg
        cache, ids, q, k4, v4 = build(cfg)
        del k4, v4
        M = cache.block_table.shape[1]
        assert (HQ, H, D, P, M, n) == (24, 24, 32, 16, 8192, M * P), "the prototype is written for paper_128k"
        assert cache.k_bounds.is_contiguous() and cache.k_pages.is_contiguous()
        Kp, npg = 64, 64
        NITEMS, IPB, NROWS = B * M // npg, M // npg, B * H
        bt = cache.block_table[ids.long()].contiguous()  # [B, M] physical pages of the batch's rows
        scale = D ** -0.5
        qc = q.contiguous()
        keys = torch.empty(NROWS * M, dtype=torch.int32, device="cuda")
        cnt = torch.zeros(B, dtype=torch.int32, device="cuda")
        glist = torch.empty(NROWS * 512, dtype=torch.int32, device="cuda")
        pages = torch.empty(NROWS * Kp, dtype=torch.int32, device="cuda")
        out = torch.empty(B, H, D, dtype=torch.float32, device="cuda")
        err = torch.zeros(2, dtype=torch.int32, device="cuda")
        ts = torch.zeros(2 * 4 * sms, dtype=torch.int64, device="cuda")  # producer start / end per program
        tr = torch.zeros(3 * NROWS, dtype=torch.int64, device="cuda")
        floor_us = (B * M * H * 2 * D * 2 + 2 * B * H * Kp * P * D * 2 + B * HQ * D * 2) / 4.26e6

        ref_step = make_step(KER, "quest_topk1024", cache, ids, q, None, None, scale)
        ref_out, ref_sel, _ = ref_step()
        ref_pages = ref_sel.pages[:, :, :Kp].sort(dim=-1).values
        assert bool((ref_sel.counts == Kp).all())

        steps, compiled = {"library quest step": ref_step}, {}
        for v in args.variants.split(","):
            ncta, pw, cw, regs, o = parse_form(v, sms, lambda pw, cw: dict(b=16, r=6, t=8, s=1, a=16, p=1, f=1))

            def step(ncta=ncta, pw=pw, cw=cw, regs=regs, o=o, v=v):
                cnt.zero_()
                compiled[v] = _ws_quest[(ncta,)](
                                  qc, bt, cache.k_bounds, keys, cache.k_pages, cache.v_pages, cnt, glist, pages, out,
                                  err, ts, tr, scale, M, NITEMS, IPB, NROWS, H=H, D=D, P=P, K=Kp, NPG=npg, BM=o["b"],
                                  PW=pw, CW=cw, REGS=regs, ONE_G=128, NT=o["t"], ROUNDS=o["r"], SEL=o["s"],
                                  SPG=o["a"], PF=o["p"], AF=o["f"], num_warps=pw)
            try:
                err.zero_()
                out.zero_()
                step()
                torch.cuda.synchronize()
            except Exception as exc:  # a form that does not compile or launch: say so (the innermost cause), go on
                while exc.__cause__ is not None or exc.__context__ is not None:
                    exc = exc.__cause__ or exc.__context__
                print(f"{cname} ws {v}: failed: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
                continue
            t0, end = timeline(step, flush, lambda ncta=ncta: ts[:2 * ncta].view(ncta, 2))
            k = compiled[v]
            line = (f"{cname} ws {v}: {getattr(k, 'n_regs', '?')} registers, {getattr(k, 'n_spills', '?')} spills; "
                    f"timeline: producers end {end.min():.1f}-{end.max():.1f} us")
            if o["s"]:
                rt = (tr.view(B, H, 3).double() - t0) / 1e3
                line += "; batch rows ready / selected / done: " + " ".join(
                    f"{rt[i, :, 0].min():.0f}-{rt[i, :, 0].max():.0f}/{rt[i, :, 1].max():.0f}/{rt[i, :, 2].max():.0f}"
                    for i in range(B))
                sel_us, att_us = (rt[..., 1] - rt[..., 0]).flatten(), (rt[..., 2] - rt[..., 1]).flatten()
                line += (f"; selection {sel_us.min():.1f}-{sel_us.max():.1f} us, attention "
                         f"{att_us.min():.1f}-{att_us.max():.1f} us")
            print(line, flush=True)
            if not o["s"]:
                steps[f"ws {v}"] = step
                continue
            got = pages.view(B, H, Kp).sort(dim=-1).values
            rows_diff = int((got != ref_pages).any(dim=-1).sum())
            dout = (out - ref_out.float()).abs().max().item()
            print(f"{cname} ws {v}: rows whose pages differ from the library's {rows_diff}/{NROWS}, "
                  f"max |out - library| {dout:.2e}, polls given up {int(err[0])}, rows past the tile {int(err[1])}",
                  flush=True)
            steps[f"ws {v}"] = step
        print(f"## {cname}: floor {floor_us:.1f} us (1.5x: {1.5 * floor_us:.1f})", flush=True)
        for rnd in range(args.rounds):
            for name, fn in steps.items():
                us = graph_us(fn, flush, args.reps)
                print(f"{cname} r{rnd} {name:28s} {us:8.1f} us  {us / floor_us:5.2f}x floor", flush=True)
        cache = steps = ref_step = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
