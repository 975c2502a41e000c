"""One context-parallel decode step: every rank scores and selects among its
own pages, the ranks agree through fixed-size collectives (combine.py).

Per policy (B batch, HQ query heads, S selection heads, R ranks):

- Full: every local page; softmax merges (out, log-sum-exp), entmax finds
  the global tau (candidate gather + certificate, Newton fallback).
- TopK: each rank sends its best ``width`` pages per selection row (rank
  value, global page), one all-gather; every rank then orders the union as
  one GPU would (forced pages first, then by bound, ties to the lower
  page) and keeps its own pages among the first ``count``.
- Gaussian: tau_hat solves the page-mixture equation summed over all ranks
  (``gaussian.solve_tau_hat`` with the group's page sums); each rank keeps
  its pages whose high quantile clears it.
- Certified: the seed (global TopK or Gaussian), tau over the seed across
  ranks, then every local page whose safe bound exceeds it; the certificate
  holds when every rank's left-out pages are proven empty against the
  final global tau.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import scoring
from ..attention import selection_mask
from ..backend import resolve_backend
from ..decode import check_call
from ..gaussian import normal_icdf, pooled_moments, solve_tau_hat
from ..policies import Certified, Full, Gaussian, TopK, compact, topk_rank
from ..types import DecodeStats, Selection
from .._checks import as_ids, as_int, describe
from .combine import (ContextParallel, GroupPageSums, all_gather, all_max, all_sum, entmax_output, entmax_tau,
                      merge_softmax, softmax_lse)
from .shard import ShardedCache, to_device

__all__ = ["ShardStats", "decode"]

_PAST = float(2 ** 40)  # the global page index padding sorts after every real one


@dataclass
class ShardStats:
    """Statistics of a context-parallel step, the same on every rank.

    Attributes:
        stats: ``DecodeStats`` over the whole sequence (pages and tokens read
            summed over ranks, the global tau, the certificate across ranks).
        rounds: int32 [B, HQ]: fallback Newton rounds each head used (0: the
            first collective certified its tau; softmax: 0).
        exact: bool [B, HQ]: the threshold is exact (certified by the first
            collective or converged in the fallback).
        collectives: collective calls the step made.
    """

    stats: DecodeStats
    rounds: torch.Tensor
    exact: torch.Tensor
    collectives: int


class _Step:
    """Shared state of one step (local layout, global page indices, counters)."""

    def __init__(self, cache: ShardedCache, kv, ids, q, alpha, scale, slopes, ops, cfg):
        self.cache, self.kv, self.ids, self.q = cache, kv, ids, q
        self.alpha, self.scale, self.slopes, self.ops, self.cfg = alpha, scale, slopes, ops, cfg
        self.group = cache.group
        self.P = cache.page_size
        self.lay = scoring.page_layout(kv, ids)  # local lengths, global positions
        self.gpage = self.lay.first // self.P  # [B, M] global page of each local page
        self.npages = (self.lay.pos_q + self.P) // self.P  # [B] global pages in use
        self.collectives = 0

    # -------------------------------------------------------------- helpers
    def gather(self, t):
        self.collectives += 1
        return all_gather(t, self.group)

    def sum(self, t):
        self.collectives += 1
        return all_sum(t, self.group)

    def forced(self, policy) -> torch.Tensor:
        """bool [B, M]: local pages every policy keeps (the global last page, sinks, window)."""
        sinks = getattr(policy, "sinks", 0)
        window = max(getattr(policy, "window", 0), 1)
        return ((self.gpage < sinks) | (self.gpage >= self.npages[:, None] - window)) & self.lay.valid

    def forced_count(self, policy) -> torch.Tensor:
        """int64 [B]: how many pages of the whole sequence are forced."""
        n = self.npages
        a = n.clamp(max=getattr(policy, "sinks", 0))
        b0 = (n - max(getattr(policy, "window", 0), 1)).clamp(min=0)
        return a + (n - b0) - (a - b0).clamp(min=0)

    def heads(self, policy) -> int:
        """Selection heads of ``policy``: one per KV head, or per query head."""
        return self.q.shape[1] if getattr(policy, "per_query_head", False) else self.cache.kv_heads

    @staticmethod
    def by_head(x: torch.Tensor, S: int) -> torch.Tensor:
        """[B, HQ, M] -> [B, S, M]: any over the query heads of a selection row."""
        B, HQ, M = x.shape
        return x.view(B, S, HQ // S, M).any(2)

    # -------------------------------------------------------------- policies
    def topk(self, policy: TopK) -> Selection:
        B, M, S = self.lay.n_tok.shape[0], self.lay.n_tok.shape[1], self.heads(policy)
        ub = self.ops.quest_bounds(self.q, self.kv, self.ids, scale=self.scale, slopes=self.slopes)
        forced = self.forced(policy)[:, None, :].expand(B, S, M)
        rank = topk_rank(ub, forced, S)  # [B, S, M]
        k_pages = max(policy.budget // self.P, 1)
        K = max(k_pages, 1 + policy.sinks + policy.window)
        # local pages are in global order, so a stable sort breaks ties to the lower page
        vals, order = rank.sort(dim=-1, descending=True, stable=True)
        kl = min(K, M)
        vals = vals[..., :kl].double()
        gp = self.gpage[:, None, :].expand(B, S, M).gather(2, order[..., :kl]).double()
        pad = K - kl
        if pad:
            vals = torch.cat((vals, vals.new_full((B, S, pad), float("-inf"))), dim=-1)
            gp = torch.cat((gp, gp.new_full((B, S, pad), _PAST)), dim=-1)
        got = self.gather(torch.stack((vals, gp), dim=-1))  # [W, B, S, K, 2]
        got = got.permute(1, 2, 0, 3, 4).reshape(B, S, -1, 2)
        v_all, g_all = got[..., 0], got[..., 1]
        by_page = g_all.sort(dim=-1, stable=True).indices
        v_all, g_all = v_all.gather(2, by_page), g_all.gather(2, by_page)
        best = v_all.sort(dim=-1, descending=True, stable=True).indices[..., :K]
        chosen = g_all.gather(2, best).long()  # [B, S, K] global pages, best first
        count = torch.minimum(self.forced_count(policy).clamp(min=k_pages), self.npages)  # [B]
        sh = self.cache.sharding
        mine = (torch.arange(K, device=chosen.device) < count[:, None, None]) & (chosen < _PAST)
        mine = mine & (self._owner(chosen) == sh.rank)
        local = torch.where(mine, sh.local_page(chosen), torch.full_like(chosen, M)).clamp(max=M)
        keep = torch.zeros(B, S, M + 1, dtype=torch.bool, device=chosen.device)
        keep.scatter_(2, local, True)
        return compact(keep[..., :M] & self.lay.valid[:, None, :], min(M, K))

    def _owner(self, page: torch.Tensor) -> torch.Tensor:
        sh = self.cache.sharding
        return page // sh.span if sh.layout == "contiguous" else page % sh.ranks

    def gaussian(self, policy: Gaussian) -> Selection:
        B, M = self.lay.n_tok.shape
        mu, sigma, n = self.ops.gaussian_stats(self.q, self.kv, self.ids, scale=self.scale, slopes=self.slopes)
        w = n[:, None, :].expand_as(mu)
        pages = GroupPageSums(self.group)
        if policy.pooled:
            mu_g, sigma_g, n_g = pooled_moments(mu, sigma, w, pages)
            tau_hat = solve_tau_hat(mu_g[..., None], sigma_g[..., None], n_g[..., None], self.alpha)
        else:
            tau_hat = solve_tau_hat(mu, sigma, w, self.alpha, pages=pages)
        self.collectives += pages.calls
        z = normal_icdf(torch.as_tensor(policy.q_max, dtype=mu.dtype, device=mu.device) ** (1.0 / n.clamp(min=1)))
        hi = (self.alpha - 1.0) * (mu + z[:, None, :] * sigma)
        keep = self.by_head(hi > (tau_hat[..., None] - policy.margin), self.heads(policy)) & self.lay.valid[:, None, :]
        sel = compact(keep | self.forced(policy)[:, None, :])
        sel.tau_hat = tau_hat.to(torch.float32)
        return sel

    def certified(self, policy: Certified, ubs: torch.Tensor) -> Selection:
        B, M = self.lay.n_tok.shape
        S = self.heads(policy)
        seed = self.topk(policy.seed) if isinstance(policy.seed, TopK) else self.gaussian(policy.seed)
        tau_a, _, _, _ = self.tau(seed)
        seed_mask = selection_mask(seed, M)
        if seed.sel_heads > S:  # seed per query head, certified per KV head: union
            seed_mask = seed_mask.view(B, S, -1, M).any(2)
        elif seed.sel_heads < S:  # seed per KV head, certified per query head: copy
            seed_mask = seed_mask.repeat_interleave(S // seed.sel_heads, dim=1)
        add = self.by_head((self.alpha - 1.0) * ubs > tau_a.view(B, -1)[..., None], S) & self.lay.valid[:, None, :]
        return compact(seed_mask | add | self.forced(policy)[:, None, :])

    # -------------------------------------------------------------- attention
    def tau(self, sel: Optional[Selection]):
        """(tau float64 [B*HQ], top, rounds, exact) over the selection on every rank."""
        scores, tokens, lower = self.ops.candidates(self.q, self.kv, self.ids, sel, alpha=self.alpha,
                                                    scale=self.scale, slopes=self.slopes)
        tau, top, rounds, exact, n = entmax_tau(scores, lower, self.alpha, self.group, self.cfg)
        self.collectives += n
        self._cand = (scores, tokens)
        return tau, top, rounds, exact

    def attend(self, sel: Optional[Selection]):
        """(out float32 [B, HQ, D], tau float32 [B, HQ], rounds, exact)."""
        B, HQ, D = self.q.shape
        if self.alpha == 1.0:
            if sel is None:
                o, lse = self.ops.dense_attend(self.q, self.kv, self.ids, alpha=1.0, scale=self.scale,
                                               slopes=self.slopes)
                empty = (self.lay.seq_len == 0)[:, None].expand(B, HQ)
            else:
                o, lse = self.ops.attend(self.q, self.kv, self.ids, sel, alpha=1.0, scale=self.scale,
                                         slopes=self.slopes)
                empty = (sel.counts == 0).repeat_interleave(HQ // sel.sel_heads, dim=1)
            out = merge_softmax(o, lse, empty, self.group)
            tau = softmax_lse(lse, empty, self.group)
            self.collectives += 3
            zero = torch.zeros(B, HQ, dtype=torch.int32, device=o.device)
            return out, tau, zero, torch.ones_like(zero, dtype=torch.bool)
        tau, top, rounds, exact = self.tau(sel)
        kv_head = (torch.arange(B * HQ, device=tau.device) % HQ) // (HQ // self.cache.kv_heads)
        scores, tokens = self._cand
        out = entmax_output(scores, tokens, tau, top, self.alpha, self.kv, kv_head, self.group)
        self.collectives += 1
        return out.view(B, HQ, D), tau.view(B, HQ).float(), rounds.view(B, HQ), exact.view(B, HQ)

    # -------------------------------------------------------------- statistics
    def stats(self, sel, out, tau, exact, ubs) -> DecodeStats:
        B, HQ, _ = self.q.shape
        M = self.lay.n_tok.shape[1]
        valid = self.lay.valid[:, None, :]
        if sel is None:
            kept = valid.expand(B, HQ, M)
        else:
            kept = selection_mask(sel, M).repeat_interleave(HQ // sel.sel_heads, dim=1) & valid
        counts = torch.stack((kept.sum(-1), (kept * self.lay.n_tok[:, None, :]).sum(-1))).to(torch.float64)
        counts = self.sum(counts)
        glen = (self.lay.pos_q + 1).to(torch.float64)[:, None]
        # the certificate: every valid local page left out is proven empty
        # against the global tau, and every bound this rank used is finite
        left = valid & ~kept
        if self.alpha == 1.0:
            proven = ~left
        else:
            proven = ~left | ((self.alpha - 1.0) * ubs <= tau[..., None].double())
        finite = (torch.isfinite(ubs) | ~valid).all(-1) & torch.isfinite(tau)
        ok = (proven.all(-1) & finite).to(torch.float64)
        self.collectives += 1
        ok = -all_max(-ok, self.group)  # the minimum over ranks
        certified = (ok > 0) & exact & torch.isfinite(out).all(-1) & torch.isfinite(self.q).all(-1)
        return DecodeStats(counts[0].to(torch.int32), counts[1].to(torch.int32),
                           (counts[1] / glen.clamp(min=1)).float(), tau.float(), certified)


def decode(
    q: torch.Tensor,
    cache: ShardedCache,
    seq_ids,
    policy=None,
    *,
    alpha: float = 1.5,
    scale: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    layer: int = 0,
    config: ContextParallel = ContextParallel(),
    return_stats: bool = False,
    backend: str = "auto",
    kernel_config=None,
    check_finite: Optional[bool] = None,
):
    """One decoding step over a context-parallel cache (every rank calls it
    with the same query and arguments; every rank returns the same output).

    Args:
        q: [batch, q_heads, head_dim] float, on this rank's device (the
            same values on every rank).
        cache: this rank's ``ShardedCache``; seq_ids: its slots (ints or an
            int tensor [batch]), each holding at least one token globally.
        policy, alpha, scale, alibi_slopes, backend, kernel_config,
            check_finite: as for ``entmaxkv.decode`` (positions are global:
            ALiBi sees the whole sequence).
        layer: which layer of the cache.
        config: ``ContextParallel`` (how the exact entmax threshold is found).
        return_stats: also return ``ShardStats``.
    Returns:
        out [batch, q_heads, head_dim] in q's dtype, or (out, ShardStats).
    """
    if not isinstance(cache, ShardedCache):
        raise ValueError(f"cache: expected an entmaxkv.distributed.ShardedCache, got {describe(cache)}")
    if not isinstance(config, ContextParallel):
        raise ValueError(f"config: expected an entmaxkv.distributed.ContextParallel, got {describe(config)}")
    policy, alpha, scale, slopes, return_stats = check_call(q, cache, policy, alpha, scale, alibi_slopes,
                                                            return_stats, backend, check_finite, kernel_config)
    B, HQ, D = q.shape
    kv = cache.layer(as_int(layer, "layer", lo=0, hi=cache.num_layers - 1))
    ids = _check_ids(seq_ids, cache, B)
    ops = resolve_backend(backend, q.device, kernel_config)
    st = _Step(cache, kv, ids, q, alpha, scale, slopes, ops, config)

    need_bounds = return_stats or isinstance(policy, Certified)
    ubs = ops.safe_bounds(q, kv, ids, scale=scale, slopes=slopes) if need_bounds else None
    if isinstance(policy, Full):
        sel = None
    elif isinstance(policy, TopK):
        sel = st.topk(policy)
    elif isinstance(policy, Gaussian):
        sel = st.gaussian(policy)
    else:
        sel = st.certified(policy, ubs)
    out, tau, rounds, exact = st.attend(sel)
    out = out.to(q.dtype)
    if not return_stats:
        return out
    stats = st.stats(sel, out, tau, exact, ubs)
    return out, ShardStats(stats, rounds, exact, st.collectives)


def _check_ids(seq_ids, cache: ShardedCache, batch: int) -> torch.Tensor:
    want = f"a list of {batch} ints or an int32/int64 tensor of shape ({batch},)"
    host = as_ids(seq_ids, "seq_ids", want)
    if host is None:
        if seq_ids.numel() != batch:
            raise ValueError(f"seq_ids: expected {want}, got {seq_ids.numel()} ids")
        return seq_ids.to(device=cache.device, dtype=torch.int32)
    if len(host) != batch:
        raise ValueError(f"seq_ids: expected {batch} ids (one per query row), got {len(host)}")
    active = set(cache.active_seqs())
    for s in host:
        if s not in active:
            raise ValueError(f"seq_ids: sequence {s} is not allocated in the cache")
        if cache.length(s) == 0:
            raise ValueError(f"seq_ids: sequence {s} is empty; append its token first")
    return to_device(list(host), torch.int32, cache.device)
