"""Launch plan of the Gaussian selection from shapes and the GaussianConfig, and
its host-side tables."""
from __future__ import annotations

from typing import Optional

import torch

from ..config import GaussianConfig
from .._common import cdiv, interpreting, next_pow2
from ..scoring import score_plan


def gauss_plan(c: GaussianConfig, M: int, NG: int, D: int, q_dtype, cache_dtype, rows: int = 1, sms: int = 1,
               interpreted: Optional[bool] = None) -> dict:
    """Launch plan for ``rows`` = B*H KV rows of NG query heads, M pages.

    CH pages per program of the iteration and selection launches: up to
    c.max_ch_many (rows * NG >= sms) or c.max_ch_few, halved (not below 1024)
    while the rows * NG query-head rows would give fewer than c.iter_per_sm
    programs per SM. CHS <= CH pages per program of the stats launch, halved
    (not below c.min_ch) until its programs hold the tuned warps per SM: 4 x
    32k GQA rows are 32 rows of 2048 pages, one chunk each kept 100 of 132
    SMs idle (68 us; 20 us at 256 programs). The stats launch's block
    (SBLOCK_M pages, SNSUB blocks per chunk), warps, stages and prefetch come
    from c.stats_tune / c.dot_stats_tune. ``interpreted``: plan for Triton's
    CPU interpreter (smaller blocks); None: whether it is running."""
    if interpreted is None:
        interpreted = interpreting()
    cfg = score_plan(NG, D, q_dtype, cache_dtype)
    block_m = cfg["BLOCK_M"]
    if cfg["USE_DOT"]:
        prefetch, (sbm, warps, stages, per_sm) = False, c.dot_stats_tune
    else:
        prefetch, sbm, warps, stages, per_sm = c.stats_tune
    sbm = sbm or block_m
    if stages is not None:  # pipelined k_mean / k_std blocks within 128 KB of shared memory
        per_stage = 2 * sbm * cfg["BLOCK_D"] * cache_dtype.itemsize
        stages = max(2, min(stages, (128 << 10) // per_stage))
    if interpreted:
        sbm = min(sbm, 64)
    many = rows * NG >= sms
    ch = max(block_m, sbm, min(256 if interpreted else (c.max_ch_many if many else c.max_ch_few), next_pow2(M)))
    while ch > max(block_m, sbm, 1024) and rows * NG * cdiv(M, ch) < c.iter_per_sm * sms:
        ch //= 2
    chs = ch
    while chs > max(sbm, c.min_ch) and rows * cdiv(M, chs) * warps < per_sm * sms:
        chs //= 2
    cfg.update(CH=ch, NCH=cdiv(M, ch), CHS=chs, NCS=cdiv(M, chs), SBLOCK_M=sbm, SNSUB=chs // sbm,
               SWARPS=warps, SSTAGES=stages, SPREFETCH=prefetch)
    return cfg


_ZTAB = {}


def z_table(q_max: float, P: int, device) -> torch.Tensor:
    """float32 [P + 1]: z_n = Phi^{-1}(q_max^(1/n)) for n = 1..P (index 0 unused).

    Cached per (q_max, P, device) so that a captured CUDA graph never copies
    from the host.
    """
    key = (float(q_max), int(P), str(device))
    if key not in _ZTAB:
        n = torch.arange(1, P + 1, dtype=torch.float32)
        p = torch.as_tensor(q_max, dtype=torch.float32) ** (1.0 / n)
        z = torch.special.ndtri(p)
        _ZTAB[key] = torch.cat([torch.zeros(1), z.to(torch.float32)]).to(device)
    return _ZTAB[key]


def _beta_kind3(alpha: float) -> int:
    for bk, a in ((1, 2.0), (2, 1.5), (3, 4.0 / 3.0)):
        if abs(alpha - a) < 1e-12:
            return bk
    return 0
