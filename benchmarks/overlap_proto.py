"""Experiment: a Quest top-k step whose selection and attention may overlap
the metadata read (a script, not a test: it times on the GPU; proto_step
also runs on the CPU under TRITON_INTERPRET=1).

    PYTHONPATH=.:benchmarks python3 benchmarks/overlap_proto.py --configs paper_128k,paper_32k,paper_512k \
        --variants kp999w4cw32,kp2w4cw32,kp999w4o,kp2w4cw32s2r128p500x
    PYTHONPATH=.:benchmarks python3 benchmarks/overlap_proto.py --alpha 1.5 --configs paper_128k --variants kp999w4o
    PYTHONPATH=.:benchmarks python3 benchmarks/overlap_proto.py --timeline --configs paper_128k \
        --variants kp999w4cw32,kp2w4cw32s2r128p500x

(Fastest measured at 8 x 128k: kp999w4cw32, 0.086 ms against the committed
step's 0.092; kp999w4o, the form that keeps the committed attention, 0.089
for Quest and 0.095 against 0.099-0.100 for entmax top-k; all slower at 1 x 2M.)

The committed step runs keys pass -> group maxima -> _rowsel_kernel ->
split -> combine, each launch after the one before has finished, so the
selection and attention of every row wait for the metadata of *all* rows.
This one has two launches (one query head per KV head, softmax only):

* ``_pkeys_kernel``: the keys pass (``topk._keys_chunk``) as a persistent
  grid of KP programs per SM looping over (batch row, chunk) items in batch
  order; after each item a barrier and a release atomic raise the batch
  row's counter. It is a PDL launch and lets its dependent launch at once.
* ``_pchain_kernel`` (ONE = False): NSPLIT programs per (batch row, KV
  head), a PDL launch that does not wait for the keys pass: each polls
  its batch row's counter (volatile loads, an optional nanosleep back-off,
  then one acquire) until every chunk is in, takes the row's group maxima,
  selects the row's pages exactly as _rowsel_kernel does
  (``topk._select_row``, into its own scratch), attends (softmax) over its
  share of them, and the row's last program to finish (a ticket atomic)
  combines the shares into the output.

A last form puts both roles in one persistent launch (``_pchain_kernel``
with ONE = True, variants "one..."): every program takes keys items and
row chains from one work queue in batch order.

Pages (per row, sorted) and outputs are checked against select_topk +
attend; the graphs are timed next to the committed step (L2 flushed,
median). Since the twelfth session the committed step itself takes the
"o" form (topk.OVERLAP) at batch >= 2 up to 32768 pages per row;
``--chain`` times the chain it replaced instead (OVERLAP = False), as the
calls in results/overlap.log did. ``--timeline`` prints %globaltimer stamps of a replayed graph per
batch row instead. Measured: benchmarks/results/overlap.log.

Variant names: [one]kp<keys programs per SM>w<warps of _pchain_kernel>
[cw<pages per attention step>][s<programs per row>][r<maxnreg>][p<poll
back-off ns>][q<consumer programs per SM>: a persistent consumer taking
chains from a work queue][a: poll by acquire atomics][k: the keys pass not
itself a PDL launch, it only triggers][nospin: no PDL, the consumer after
the keys pass]
[x: no PDL, the consumer launched on a side stream (a parallel branch of
the graph, no dependency on the keys pass) so that the two may run at once]
[o: the consumer only selects; the committed attention launches follow].
"kp999": KP so large that the keys grid has one program per item (the
committed pass's grid, in batch order). ``--alpha 1.5`` times entmax top-k
("o" variants only) against the committed entmax_topk1024 step.
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext as _nullctx

import torch
import triton
import triton.language as tl
from bench_decode import CONFIGS, METHODS, build, capture, make_step, time_graph

from entmaxkv.kernels import attend, topk
from entmaxkv.kernels import select as kselect
from entmaxkv.kernels._common import cdiv, gdc_launch_dependents, gdc_wait, next_pow2, num_sms
from entmaxkv.kernels.scoring import meta_strides, prep_query
from entmaxkv.kernels.topk import (_keys_chunk, _row_gmax, _select_row, half_offset, keys_plan, row_budget,
                                   rowsel_plan, topk_width)
from entmaxkv.policies import TopK
from entmaxkv.types import Selection

LAUNCHED = {}  # the last launches' compiled kernels (register counts)
_SIDE = {}  # device -> the side stream of the "x" variants
STAMPS = {}  # the last launches' %globaltimer stamps (timing=True)


@triton.jit
def _now(TIMING: tl.constexpr):
    """The GPU's global nanosecond timer (0 when not timing)."""
    if TIMING:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.program_id(0)], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = tl.zeros([], tl.int64)
    return t


@triton.jit
def _kv_tile(p_sel, n_my, bt_ptr, seq, n, M, k_ptr, v_ptr, h, skp, skh, skr, svp, svh, svr,
             P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CW: tl.constexpr):
    """K and V [CW, P, BLOCK_D] of the first CW of the n_my logical pages
    listed at p_sel (zeros past them), and their token mask [CW, P]."""
    o_w = tl.arange(0, CW)
    o_k = tl.arange(0, P)
    o_d = tl.arange(0, BLOCK_D)
    m_w = o_w < n_my
    lp = tl.load(p_sel + o_w, mask=m_w, other=0)
    phys = tl.load(bt_ptr + seq * M + lp, mask=m_w, other=0).to(tl.int64)
    m_t = m_w[:, None] & (o_k[None, :] < (n - lp * P)[:, None])
    m_kv = m_t[:, :, None] & (o_d < D)[None, None, :]
    b_k = tl.load(k_ptr + (phys * skp + h * skh)[:, None, None] + o_k[None, :, None] * skr + o_d[None, None, :],
                  mask=m_kv, other=0.0)
    b_v = tl.load(v_ptr + (phys * svp + h * svh)[:, None, None] + o_k[None, :, None] * svr + o_d[None, None, :],
                  mask=m_kv, other=0.0)
    return b_k, b_v, m_t


@triton.jit
def _pkeys_kernel(
    q_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, key_ptr, cnt_ptr,
    scale, stride_qb, stride_qh, stride_mp, stride_mh, half_off,
    M, MK, sinks, window, k_pages, n_items, NCH,
    H: tl.constexpr, HG: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, NSUB: tl.constexpr, AS_IS: tl.constexpr, TRIGGER: tl.constexpr, WAIT: tl.constexpr,
    tk_ptr, TIMING: tl.constexpr,
):
    """The keys pass as a persistent grid: items (batch row, chunk) in batch
    order, each published by raising its batch row's counter cnt[b]."""
    if WAIT:  # a PDL launch itself: wait for the kernel before
        gdc_wait()
    if TRIGGER:  # let the consumer launch
        gdc_launch_dependents()
    if TIMING:
        tl.store(tk_ptr + tl.program_id(0) * 2, _now(TIMING))
    for it in range(tl.program_id(0), n_items, tl.num_programs(0)):
        i_b = it // NCH
        _keys_chunk(q_ptr, q_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, key_ptr, key_ptr, i_b, it % NCH,
                    scale, stride_qb, stride_qh, stride_mp, stride_mh, half_off, M, MK, sinks, window, k_pages,
                    H, HG, P, D, BLOCK_D, BLOCK_M, NSUB, False, False, AS_IS)
        # every thread's keys stored before the release that publishes them
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + i_b, 1, sem="release", scope="gpu")
    if TIMING:
        tl.store(tk_ptr + tl.program_id(0) * 2 + 1, _now(TIMING))


@triton.jit
def _pchain_kernel(
    kmin_ptr, qctr_ptr, tk_ptr, half_off, stride_mp, stride_mh, B,
    ids_ptr, lens_ptr, key_ptr, cnt_ptr, flag_ptr, gmax_ptr, glist_ptr, ck_ptr, cp_ptr, pages_ptr, counts_ptr,
    q_ptr, k_ptr, v_ptr, bt_ptr, out_ptr, sel_ptr, pm_ptr, pl_ptr, pacc_ptr, tick_ptr,
    MK, NKP, W, M, sinks, window, k_pages, NCH, scale,
    stride_qb, stride_qh, skp, skh, skr, svp, svh, svr, stride_ob, stride_oh,
    S: tl.constexpr, P: tl.constexpr, GS: tl.constexpr, NKP_P2: tl.constexpr, GT: tl.constexpr,
    GB: tl.constexpr, CAP: tl.constexpr, SMALL: tl.constexpr, ONE_G: tl.constexpr, NT: tl.constexpr,
    FEW: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, CW: tl.constexpr, SPIN: tl.constexpr,
    NSPLIT: tl.constexpr, SHARE: tl.constexpr, tf_ptr, TIMING: tl.constexpr, POLL_NS: tl.constexpr,
    POLL_ATOMIC: tl.constexpr, QUEUE: tl.constexpr, ATTEND: tl.constexpr,
    H: tl.constexpr, HG: tl.constexpr, BLOCK_M: tl.constexpr, NSUB: tl.constexpr, AS_IS: tl.constexpr,
    ONE: tl.constexpr,
):
    """ONE = False: the consumer launch, row-chain program = program id.
    ONE = True: both roles in one persistent launch: each program takes
    items from one work queue (an atomic counter) in the order keys(0),
    keys(1), chains(0), keys(2), chains(1), ..., chains(B-1), where keys(b)
    are batch row b's NCH keys items and chains(b) its S * NSPLIT row-chain
    items. A chain waits only on keys items handed out before it, to
    programs that never wait, so no program waits on one that has not
    started (any grid size; the interpreter runs programs one at a time)."""
    C: tl.constexpr = S * NSPLIT
    if ONE:
        total = B * (NCH + C)
        if TIMING:
            tl.store(tk_ptr + tl.program_id(0) * 2, _now(TIMING))
        t = tl.atomic_add(qctr_ptr, 1, sem="relaxed")
    else:
        total = B * C
        if QUEUE:  # a persistent consumer: chains from a work queue, in batch order
            t = tl.atomic_add(qctr_ptr, 1, sem="relaxed")
        else:
            t = tl.program_id(0)
    while t < total:
        if ONE:
            u = t - NCH
            j = tl.where(t < NCH, 0, 1 + u // (NCH + C))
            r = tl.where(t < NCH, t, u % (NCH + C))
            is_keys = (j < B) & (r < NCH)
            if is_keys:  # keys item: batch row j, chunk r
                _keys_chunk(q_ptr, q_ptr, ids_ptr, lens_ptr, bt_ptr, kmin_ptr, key_ptr, key_ptr, j, r,
                            scale, stride_qb, stride_qh, stride_mp, stride_mh, half_off, M, MK, sinks, window,
                            k_pages, H, HG, P, D, BLOCK_D, BLOCK_M, NSUB, False, False, AS_IS)
                tl.debug_barrier()
                tl.atomic_add(cnt_ptr + j, 1, sem="release", scope="gpu")
            do_chain = is_keys == 0
            # else a chain of batch row j - 1 (the last block holds only chains)
            x = (j - 1) * C + tl.where(j >= B, u - (B - 1) * (NCH + C), r - NCH)
        else:  # (no keys code in the consumer launch: a constexpr branch)
            do_chain = True
            x = t
        if do_chain:
            # a row chain, program i_x of NSPLIT per row: each selects the whole row
            # (the same pages, in its own scratch) and attends its SHARE of them;
            # the row's last program to finish combines the partials
            i_x = x.to(tl.int64)
            i_r = i_x // NSPLIT
            i_sp = i_x % NSPLIT
            i_b = i_r // S
            h = i_r % S
            if TIMING:  # stamps: 0 start, 1 released, 2 maxima, 3 selected, 4 attended, 5 done
                tl.store(tf_ptr + i_x * 6, _now(TIMING))
            if SPIN:
                # poll with plain volatile loads and a back-off (hundreds of programs
                # polling by atomics would load L2 while the keys pass reads), then
                # one acquire for the ordering
                if POLL_ATOMIC:  # (or by acquire atomics, as the first form did)
                    c = tl.atomic_add(cnt_ptr + i_b, 0, sem="acquire", scope="gpu")
                else:
                    c = tl.load(cnt_ptr + i_b, volatile=True)
                k = 0
                while (c < NCH) & (k < 200000):
                    if POLL_NS > 0:
                        tl.inline_asm_elementwise("{ nanosleep.u32 $1; mov.u32 $0, 0; }", "=r,r",
                                                  [tl.full([], POLL_NS, tl.int32)], dtype=tl.int32,
                                                  is_pure=False, pack=1)
                    if POLL_ATOMIC:
                        c = tl.atomic_add(cnt_ptr + i_b, 0, sem="acquire", scope="gpu")
                    else:
                        c = tl.load(cnt_ptr + i_b, volatile=True)
                    k += 1
                c = tl.atomic_add(cnt_ptr + i_b, 0, sem="acquire", scope="gpu")
                if c < NCH:
                    tl.atomic_add(flag_ptr, 1, sem="relaxed")
            tl.debug_barrier()
            if TIMING:
                tl.store(tf_ptr + i_x * 6 + 1, _now(TIMING))
            seq = tl.load(ids_ptr + i_b).to(tl.int64)
            n = tl.load(lens_ptr + seq)
            npages, wnd, k_row = row_budget(n, sinks, window, k_pages, P)
            p_row = key_ptr + i_r * MK
            # -- group maxima of the row (keys read past L1: other SMs wrote them)
            _row_gmax(p_row, gmax_ptr + i_x * NKP, NKP, GS, GT)
            if TIMING:
                tl.store(tf_ptr + i_x * 6 + 2, _now(TIMING))
            # -- _rowsel_kernel's selection (E = 0), into this program's scratch
            if NSPLIT == 1:  # one program per row: select straight into the Selection's row
                p_mine = pages_ptr + i_r * W
            else:
                p_mine = sel_ptr + i_x * W
            n_out = _select_row(p_row, gmax_ptr, i_x, glist_ptr + i_x * NKP_P2, ck_ptr + i_x * CAP, cp_ptr + i_x * CAP,
                                p_mine, NKP, k_row, GS, NKP_P2, GB, CAP, SMALL, ONE_G, NT, FEW, 0, ".cg")
            tl.debug_barrier()  # the row's pages are read back by every thread
            if TIMING:
                tl.store(tf_ptr + i_x * 6 + 3, _now(TIMING))
            if NSPLIT > 1:
                if i_sp == 0:
                    o_all = tl.arange(0, NKP_P2)  # (W <= NKP)
                    tl.store(pages_ptr + i_r * W + o_all, tl.load(sel_ptr + i_x * W + o_all, mask=o_all < n_out),
                             mask=o_all < n_out)
            if i_sp == 0:
                tl.store(counts_ptr + i_r, n_out)
            if ATTEND:  # (else the committed attention launches follow)
                # -- softmax over this program's SHARE of the pages, CW per step, the next step's K/V in flight
                p_sel = p_mine + i_sp * SHARE
                n_my = tl.minimum(tl.maximum(n_out - i_sp * SHARE, 0), SHARE)
                o_d = tl.arange(0, BLOCK_D)
                m_d = o_d < D
                b_qv = tl.load(q_ptr + i_b * stride_qb + h * stride_qh + o_d, mask=m_d, other=0.0)
                b_qv = b_qv.to(tl.float32) * scale
                m_i = tl.full([], float("-inf"), tl.float32)
                l_i = tl.zeros([], tl.float32)
                acc = tl.zeros([BLOCK_D], tl.float32)
                b_k, b_v, m_t = _kv_tile(p_sel, n_my, bt_ptr, seq, n, M, k_ptr, v_ptr, h, skp, skh, skr, svp, svh, svr,
                                         P, D, BLOCK_D, CW)
                for w0 in range(0, n_my if SHARE > CW else 0, CW):
                    c_k = b_k
                    c_v = b_v
                    c_t = m_t
                    b_k, b_v, m_t = _kv_tile(p_sel + w0 + CW, n_my - w0 - CW, bt_ptr, seq, n, M, k_ptr, v_ptr, h,
                                             skp, skh, skr, svp, svh, svr, P, D, BLOCK_D, CW)
                    s = tl.sum(c_k.to(tl.float32) * b_qv[None, None, :], axis=2)
                    s = tl.where(c_t, s, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(tl.max(s, axis=1), axis=0))
                    corr = tl.exp(m_i - m_new)
                    p = tl.where(c_t, tl.exp(s - m_new), 0.0)
                    l_i = l_i * corr + tl.sum(tl.sum(p, axis=1), axis=0)
                    acc = acc * corr + tl.sum(tl.sum(p[:, :, None] * c_v.to(tl.float32), axis=1), axis=0)
                    m_i = m_new
                if SHARE <= CW:  # the whole share in the tile loaded above
                    s = tl.sum(b_k.to(tl.float32) * b_qv[None, None, :], axis=2)
                    s = tl.where(m_t, s, float("-inf"))
                    m_i = tl.max(tl.max(s, axis=1), axis=0)
                    p = tl.where(m_t, tl.exp(s - m_i), 0.0)
                    l_i = tl.sum(tl.sum(p, axis=1), axis=0)
                    acc = tl.sum(tl.sum(p[:, :, None] * b_v.to(tl.float32), axis=1), axis=0)
                if TIMING:
                    tl.store(tf_ptr + i_x * 6 + 4, _now(TIMING))
                if NSPLIT == 1:
                    o = tl.where(l_i > 0, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)
                    tl.store(out_ptr + i_b * stride_ob + h * stride_oh + o_d, o.to(out_ptr.dtype.element_ty), mask=m_d)
                else:
                    tl.store(pm_ptr + i_x, m_i)
                    tl.store(pl_ptr + i_x, l_i)
                    tl.store(pacc_ptr + i_x * BLOCK_D + o_d, acc)
                    tl.debug_barrier()  # every thread's partial stored before the ticket publishes it
                    ticket = tl.atomic_add(tick_ptr + i_r, 1, sem="acq_rel", scope="gpu")
                    if ticket == NSPLIT - 1:  # the row's last program: combine (partials read past L1)
                        o_sp = tl.arange(0, NSPLIT)
                        b_m = tl.load(pm_ptr + i_r * NSPLIT + o_sp, cache_modifier=".cg")
                        b_l = tl.load(pl_ptr + i_r * NSPLIT + o_sp, cache_modifier=".cg")
                        b_a = tl.load(pacc_ptr + (i_r * NSPLIT + o_sp)[:, None] * BLOCK_D + o_d[None, :],
                                      cache_modifier=".cg")
                        m_all = tl.max(b_m, axis=0)
                        f = tl.where(b_m > float("-inf"), tl.exp(b_m - m_all), 0.0)
                        l_all = tl.sum(b_l * f, axis=0)
                        o = tl.sum(b_a * f[:, None], axis=0)
                        o = tl.where(l_all > 0, o / tl.where(l_all > 0, l_all, 1.0), 0.0)
                        tl.store(out_ptr + i_b * stride_ob + h * stride_oh + o_d, o.to(out_ptr.dtype.element_ty),
                                 mask=m_d)
            if TIMING:
                tl.store(tf_ptr + i_x * 6 + 5, _now(TIMING))
        if ONE or QUEUE:
            t = tl.atomic_add(qctr_ptr, 1, sem="relaxed")
        else:
            t = total
    if ONE:
        if TIMING:
            tl.store(tk_ptr + tl.program_id(0) * 2 + 1, _now(TIMING))


def proto_step(q, cache, ids, *, budget, scale, KP=2, spin=None, warps=4, CW=16, NSPLIT=1, maxnreg=None,
               timing=False, poll=0, poll_atomic=False, keys_pdl=True, one=False, side=False, cq=0, only_select=False,
               alpha=1.0, sinks=0, window=0):
    """One overlapped Quest top-k step (one query head per KV head; q [B, H, D]).
    ``one``: both roles in one persistent launch (_pchain_kernel with ONE,
    KP programs per SM of ``warps`` warps) instead of the keys pass + the
    consumer launch. ``side``: the consumer on a side stream that waits only
    for the counters' memset, not for the keys pass (no PDL); the caller's
    stream waits for it before returning. ``cq`` > 0: the consumer as a
    persistent grid of cq programs per SM taking row chains from a work queue
    in batch order (else one program per chain). ``only_select``: the
    consumer stops after the selection and the committed ``attend`` (alpha)
    runs over it.
    Returns (out [B, H, D] in q's dtype, pages int32 [B, H, W], counts int32
    [B, H], flag int32 [1]: chain programs whose poll gave up)."""
    q = prep_query(q)
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    assert HQ == H, "prototype: one query head per KV head"
    S = H
    M = cache.block_table.shape[1]
    k_pages, W = topk_width(M, P, budget, sinks, window)
    dev = q.device
    sms = num_sms(dev) if dev.type == "cuda" else 4
    kp = keys_plan(B, M, H, D, sms)
    KCH = kp["KCH"]
    NCH = cdiv(M, KCH)
    MK = NCH * KCH
    keys = torch.empty(B * S * MK, dtype=torch.int32, device=dev)
    # every counter the step starts from zero in one buffer (one memset per
    # step): batch rows' published chunks, polls given up, rows' finished
    # shares, the one-launch form's work queue
    counters = torch.zeros(B + 1 + B * S + 1, dtype=torch.int32, device=dev)
    cnt, flag, tick, qctr = counters[:B], counters[B:B + 1], counters[B + 1:B + 1 + B * S], counters[-1:]
    if side:  # the side stream's consumer waits for this point (the memset), not for the keys pass
        fork = torch.cuda.Event()
        fork.record()
    smp, smh = meta_strides(cache)
    half = half_offset(cache.k_min, cache.k_max)
    n_items = B * NCH
    on_gpu = dev.type == "cuda"
    nprog = KP * sms if one else min(n_items, KP * sms)  # the persistent grid (keys pass or one launch)
    # %globaltimer stamps, every one written by its program when timing (read only then)
    tk = torch.empty(nprog * 2, dtype=torch.int64, device=dev)
    tf = torch.empty(B * S * NSPLIT * 6, dtype=torch.int64, device=dev)
    STAMPS["keys"], STAMPS["fin"] = tk, tf
    pdl = on_gpu and spin is not False and gdc_launch_dependents is not None and not one and not side
    if not one:
        LAUNCHED["keys"] = _pkeys_kernel[(nprog,)](
            q, ids, cache.seq_lens, cache.block_table, cache.k_min, keys, cnt,
            float(scale), q.stride(0), q.stride(1), smp, smh, half,
            M, MK, sinks, window, k_pages, n_items, NCH,
            H=H, HG=kp["HG"], P=P, D=D, BLOCK_D=next_pow2(D), BLOCK_M=kp["BLOCK_M"], NSUB=KCH // kp["BLOCK_M"],
            AS_IS=topk.KEYS_AS_IS, TRIGGER=pdl, WAIT=pdl and keys_pdl, tk_ptr=tk, TIMING=timing,
            num_warps=kp["WARPS"], **(dict(launch_pdl=True) if pdl and keys_pdl else {}),
        )
    # the selection's shapes, as launch_rowsel sizes them
    _, NKP, rp = rowsel_plan(MK, KCH, W)
    X = B * S * NSPLIT  # chain programs, each with its own selection scratch
    gmax = torch.empty(X * NKP, dtype=torch.int32, device=dev)
    glist = torch.empty(X * rp["NKP_P2"], dtype=torch.int32, device=dev)
    ck = torch.empty(X * rp["CAP"], dtype=torch.int32, device=dev)
    sel = torch.empty(X * W, dtype=torch.int32, device=dev)
    pm = torch.empty(X, dtype=torch.float32, device=dev)
    pl = torch.empty(X, dtype=torch.float32, device=dev)
    pacc = torch.empty(X * next_pow2(D), dtype=torch.float32, device=dev)
    cpg = torch.empty_like(ck)
    pages = torch.empty(B, S, W, dtype=torch.int32, device=dev)
    counts = torch.empty(B, S, dtype=torch.int32, device=dev)
    out = torch.empty(B, HQ, D, dtype=q.dtype, device=dev)
    kv = cache.k_pages.stride()
    vv = cache.v_pages.stride()
    share = cdiv(cdiv(W, NSPLIT), CW) * CW
    chain = (
        ids, cache.seq_lens, keys, cnt, flag, gmax, glist, ck, cpg, pages, counts,
        q, cache.k_pages, cache.v_pages, cache.block_table, out, sel, pm, pl, pacc, tick,
        MK, NKP, W, M, sinks, window, k_pages, NCH, float(scale),
        q.stride(0), q.stride(1), kv[0], kv[1], kv[2], vv[0], vv[1], vv[2], out.stride(0), out.stride(1),
    )
    consts = dict(
        S=S, P=P, NT=topk.ROWSEL_NT, **rp,
        D=D, BLOCK_D=next_pow2(D), CW=CW, SPIN=on_gpu if spin is None else spin, NSPLIT=NSPLIT, SHARE=share,
        tf_ptr=tf, TIMING=timing, POLL_NS=poll, POLL_ATOMIC=poll_atomic, QUEUE=bool(cq) and not one,
        ATTEND=not only_select,
        num_warps=warps,
        **(dict(maxnreg=maxnreg) if maxnreg else {}),
    )
    # keys steps (one launch) of about 8K values: BLOCK_M pages x HG heads x 2 x D
    bm = max(1, min(kp["BLOCK_M"], 8192 // (kp["HG"] * 2 * next_pow2(D)) * warps // 4))
    main = torch.cuda.current_stream() if side else None
    if side:  # fork: the side stream waits for the memset's event, recorded before the keys launch
        _SIDE.setdefault(dev, torch.cuda.Stream(dev))
        _SIDE[dev].wait_event(fork)
    with torch.cuda.stream(_SIDE[dev]) if side else _nullctx():
        LAUNCHED["one" if one else "fin"] = _pchain_kernel[(nprog if one else min(X, cq * sms) if cq else X,)](
            cache.k_min, qctr, tk, half, smp, smh, B, *chain,
            H=H, HG=kp["HG"], BLOCK_M=bm, NSUB=KCH // bm, AS_IS=topk.KEYS_AS_IS, ONE=one, **consts,
            **(dict(launch_pdl=True) if pdl else {}),
        )
    if side:  # join (every buffer above is freed after this, ordered after the consumer)
        main.wait_stream(_SIDE[dev])
    if only_select:
        assert NSPLIT == 1 and not one, "only_select: one consumer program per row"
        out, _ = attend(q, cache, ids, Selection(pages, counts), alpha=alpha, scale=scale)
    else:
        assert alpha == 1.0, "the consumer's own attention is softmax"
    return out, pages, counts, flag


def check(q, cache, ids, scale, budget, res, alpha=1.0):
    """Against the committed step (select + attend): (the same pages in every
    row, max |out - its out|, consumer programs whose poll gave up)."""
    sel = kselect(TopK(budget), q, cache, ids, alpha=alpha, scale=scale)
    ref, _ = attend(q, cache, ids, sel, alpha=alpha, scale=scale)
    out, pages, counts, flag = res
    same = bool(torch.equal(counts, sel.counts))
    W = pages.shape[-1]
    o_w = torch.arange(W, device=pages.device)
    a = torch.where(o_w < counts[..., None], pages, -1).sort(-1).values
    b = torch.where(o_w < sel.counts[..., None], sel.pages, -1).sort(-1).values
    same = same and bool(torch.equal(a, b))
    return same, (out.float() - ref.float()).abs().max().item(), int(flag.item())


def parse_variant(v):
    """The keywords of proto_step for a variant name: [one]kp<programs per SM>w<warps>[cw<pages per step>]
    [s<splits>][r<maxnreg>][p<poll ns>][q<consumer programs per SM>][a][k][nospin][x][o]."""
    import re

    m = re.fullmatch(r"(one)?kp(\d+)w(\d+)(?:cw(\d+))?(?:s(\d+))?(?:r(\d+))?(?:p(\d+))?(?:q(\d+))?"
                     r"(a)?(k)?(nospin)?(x)?(o)?", v)
    return dict(one=bool(m.group(1)), KP=int(m.group(2)), warps=int(m.group(3)), CW=int(m.group(4) or 16),
                NSPLIT=int(m.group(5) or 1), maxnreg=int(m.group(6)) if m.group(6) else None,
                poll=int(m.group(7) or 0), cq=int(m.group(8) or 0), poll_atomic=bool(m.group(9)),
                keys_pdl=not m.group(10), spin=False if m.group(11) else None, side=bool(m.group(12)),
                only_select=bool(m.group(13)))


def timeline(name, variants, q, cache, ids, scale, flush):
    """Print, per variant and batch row, when (us after the keys pass began) the keys pass ended and the
    row's programs were released, had their maxima, had selected, had attended and were done."""
    B = q.shape[0]
    for v in variants:
        kw = parse_variant(v)
        g, _ = capture(lambda kw=kw: proto_step(q, cache, ids, budget=1024, scale=scale, timing=True, **kw))
        res = []
        for _ in range(6):  # replays of the CUDA graph (its stamps land in the captured buffers)
            flush.zero_()
            g.replay()
            torch.cuda.synchronize()
            tk = STAMPS["keys"].view(-1, 2).double()
            tf = STAMPS["fin"].view(B, -1, 6).double()
            t0 = tk[:, 0].min()
            res.append(((tk[:, 1].max() - t0) / 1e3, (tf - t0) / 1e3))
        kend, tf = res[-1]  # the last of six replays
        print(f"{name:12s} {v:16s} keys pass {kend:.1f} us; per batch row: started / released / maxima / "
              f"selected / attended / done (median over its programs; max for done)")
        for b in range(B):
            med = tf[b].median(dim=0).values
            print(f"  b{b}: " + " / ".join(f"{x:.1f}" for x in med[:5].tolist()) + f" / {tf[b, :, 5].max():.1f}")
        print(f"  step end {tf[:, :, 5].max():.1f} us")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="paper_128k,paper_32k,paper_512k")
    ap.add_argument("--variants", default="kp2w4cw32,kp2w4cw32s2r128p500,kp2w4cw16s4r128p500,kp2w4cw16s4r128nospin",
                    help="comma-separated variant names (module docstring)")
    ap.add_argument("--alpha", type=float, default=1.0, help="1.0 (Quest top-k) or 1.5 (entmax top-k, 'o' only)")
    ap.add_argument("--chain", action="store_true",
                    help="the committed step with topk.OVERLAP = False (the chain the overlapped selection replaced)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--timeline", action="store_true",
                    help="instead of timing graphs: %%globaltimer stamps of a replayed graph, per batch row (us "
                         "from the keys pass's first program)")
    args = ap.parse_args(argv)

    import entmaxkv.kernels as K

    if args.chain:
        topk.OVERLAP = False

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        cache, ids, q, k4, v4 = build(cfg)
        scale = cfg[4] ** -0.5
        if args.timeline:
            timeline(name, args.variants.split(","), q, cache, ids, scale, flush)
            continue
        method = "quest_topk1024" if args.alpha == 1.0 else "entmax_topk1024"
        assert METHODS[method][0] == args.alpha, "--alpha: 1.0 or bench_decode's ALPHA"
        g, _ = capture(make_step(K, method, cache, ids, q, k4, v4, scale))
        rows = {"committed": g}
        for v in args.variants.split(","):
            def step(kw=parse_variant(v)):
                return proto_step(q, cache, ids, budget=1024, scale=scale, alpha=args.alpha, **kw)
            res = step()
            torch.cuda.synchronize()
            regs = {k: (getattr(c, "n_regs", None), getattr(c, "n_spills", None)) for k, c in LAUNCHED.items()}
            ok = check(q, cache, ids, scale, 1024, res, args.alpha)
            print(f"{name:12s} {v:12s} eager pages_same/dout/timeouts={ok} "
                  f"regs/spills={regs}")
            g, res = capture(step)
            g.replay()
            torch.cuda.synchronize()
            ok = check(q, cache, ids, scale, 1024, res, args.alpha)
            print(f"{name:12s} {v:12s} graph pages_same/dout/timeouts={ok}")
            rows[v] = g
        for rnd in range(2):
            line = []
            for v, g in rows.items():
                ms, _ = time_graph(g, flush, args.warmup, args.reps, warm_ms=100)
                line.append(f"{v}={ms:.4f}")
            print(f"{name:12s} round {rnd}: " + " ".join(line), flush=True)


if __name__ == "__main__":
    main()
