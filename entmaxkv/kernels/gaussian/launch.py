"""The Gaussian selection's launches and its public function ``select_gaussian``."""
from __future__ import annotations

import torch

from ...types import Selection
from ..config import resolve
from .._common import alloc, as_slopes, cdiv, no_positions, launch_opts, next_pow2, num_sms
from ..scoring import meta_strides, prep_query
from .plan import _beta_kind3, gauss_plan, z_table
from .solve import _gauss_iter_kernel, _gauss_select_kernel
from .stats import _gauss_start_kernel, _gauss_stats_kernel


def select_gaussian(policy, q, cache, seq_ids, *, alpha: float, scale: float, slopes=None,
                    config=None, ws=None) -> Selection:
    """Gaussian-aware selection (Triton).

    Args:
        policy: entmaxkv.policies.Gaussian (q_max, margin, pooled, sinks,
            window, per_query_head).
        q: [batch, q_heads, head_dim]; cache; seq_ids int [batch]; alpha > 1;
            scale; slopes optional [q_heads].
    Returns:
        Selection(pages int32 [batch, S, M] unsorted, counts int32 [batch, S],
        tau_hat float32 [batch, q_heads]).
    alpha must be 2, 1.5 or 4/3 (closed-form truncated moments); other alpha
    use the reference implementation (correct, not fused). ``ws``: a
    Workspace for the scratch and the Selection's tensors (None: torch.empty).
    """
    if alpha <= 1.0:
        raise ValueError("policy: gaussian needs entmax (alpha > 1)")
    no_positions(cache, "the Gaussian selection")
    bk = _beta_kind3(alpha)
    if bk == 0:
        from ... import policies as _ref

        return _ref.select(policy, q, cache, seq_ids, alpha=alpha, scale=scale, slopes=slopes)
    q = prep_query(q)
    B, HQ, D = q.shape
    H, P = cache.kv_heads, cache.page_size
    G = HQ // H
    S = HQ if policy.per_query_head else H
    NG = HQ // S
    M = cache.block_table.shape[1]
    R = B * HQ
    dev = q.device
    config = resolve(config)
    c = config.gaussian
    cfg = gauss_plan(c, M, G, D, q.dtype, cache.dtype, B * H, num_sms(dev))
    NCH, CH = cfg["NCH"], cfg["CH"]
    nch_p2 = next_pow2(NCH)
    smp, smh = meta_strides(cache, ("k_mean", "k_std"))
    mem = alloc(ws)
    sl = as_slopes(slopes, HQ, dev, ws)
    ids = seq_ids.to(device=dev, dtype=torch.int32)
    am1, beta = float(alpha - 1.0), float(1.0 / (alpha - 1.0))
    mu = mem.empty((B, HQ, M), torch.float32, dev)
    sg = mem.empty((B, HQ, M), torch.float32, dev)
    opts = launch_opts(dev, config.pdl)
    NC = cfg["NCS"]
    stages = {} if cfg["SSTAGES"] is None else dict(num_stages=cfg["SSTAGES"])
    pages = mem.empty((B, S, M), torch.int32, dev)  # padding past counts is never read
    counts = mem.empty((B, S), torch.int32, dev)  # zeroed by the stats launch
    tau_hat = mem.empty((B, HQ), torch.float32, dev)
    st = mem.empty((R, NC, 5), torch.float32, dev)
    _gauss_stats_kernel[(B * H, NC)](
        q, sl, ids, cache.seq_lens, cache.block_table, cache.k_mean, cache.k_std,
        mu, sg, st, counts,
        float(scale), am1, q.stride(0), q.stride(1), smp, smh,
        HQ, G, M,
        H=H, NCH=NC, NSR=S // H, P=P, D=D, BLOCK_G=cfg["BLOCK_G"], BLOCK_D=cfg["BLOCK_D"],
        BLOCK_M=cfg["SBLOCK_M"], NSUB=cfg["SNSUB"], HAS_ALIBI=slopes is not None,
        USE_DOT=cfg["USE_DOT"], DOT_F32=cfg["DOT_F32"], PREC=cfg["PREC"], PREFETCH=cfg["SPREFETCH"],
        num_warps=cfg["SWARPS"], **stages, **opts,
    )
    nit = 0 if policy.pooled else c.nit
    # two start points only under ALiBi (see _gauss_start_kernel)
    two = slopes is not None and not policy.pooled
    state = mem.empty((max(nit, 1), R, 4), torch.float64, dev)
    part = mem.empty((max(nit, 1), R, NCH, 6), torch.float64, dev)
    _gauss_start_kernel[(R,)](
        st, state, NC, am1, beta,
        BLOCK_C=min(1024, next_pow2(NC)), POOLED=policy.pooled, ITERS=c.scalar_iters, START_ITERS=c.start_iters,
        BETA_KIND=bk, TWO=two, num_warps=4, **opts,
    )
    block = min(c.iter_block, CH)
    for it in range(nit):
        _gauss_iter_kernel[(R, NCH)](
            ids, cache.seq_lens, mu, sg, part, state,
            it, R, M, am1, beta,
            NCH=NCH, NCH_P2=nch_p2, CH=CH, BLOCK=block, HQ=HQ, P=P,
            BETA_KIND=bk, FIRST=it == 0, CONV=float(c.conv_tol), TWO=two, num_warps=c.iter_warps, **opts,
        )
    # one block of pages per program (no partials to merge, unlike the iteration launches)
    sel = max(16, min(CH, c.sel_ch, 4096 // next_pow2(NG)))
    _gauss_select_kernel[(B * S, cdiv(M, sel))](
        ids, cache.seq_lens, mu, sg, part, state, z_table(policy.q_max, P, dev),
        pages, counts, tau_hat,
        R, M, am1, beta, float(policy.margin), int(policy.sinks), int(policy.window),
        NCH=NCH, NCH_P2=nch_p2, BLOCK=sel,
        HQ=HQ, S=S, NG=NG, BLOCK_G=next_pow2(NG), P=P, NIT=nit, CONV=float(c.conv_tol), TWO=two,
        num_warps=c.select_warps,
        **opts,
    )
    return Selection(pages, counts, tau_hat)
