"""The cross-rank half of a context-parallel step: fixed-size collectives that
turn every rank's partial result into the whole sequence's.

- softmax (alpha = 1): the usual merge of (output, log-sum-exp) pairs;
- entmax: tau is one root over all ranks' scores, with no log-sum-exp to
  merge. Each rank sends its top m + 1 candidate scores per head; tau_U,
  the threshold over the union of the top m's, is a lower bound on tau
  (a subset's threshold never exceeds the whole set's, docs/spec.md §1).
  When every rank's (m+1)-th score and its unlisted tokens' bound sit at
  or below tau_U / (alpha - 1), no token outside the union can have
  weight at tau_U, so tau = tau_U exactly: one collective. Otherwise a
  fixed number of safeguarded Newton rounds, each one all-reduce of
  per-head sums, from that lower bound. The output is then one all-reduce
  of every rank's sum of p v.

Every collective has a size fixed by the shapes, so a step can be captured
in a CUDA graph, and none reads a device value on the host (except
``ContextParallel.sync``, which skips unneeded fallback rounds by reading
one flag).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist

from .._checks import as_bool, as_int
from ..entmax import entmax_threshold
from ..gaussian import PageSums

__all__ = ["ContextParallel", "GroupPageSums", "all_gather", "all_sum", "merge_softmax", "entmax_tau",
           "entmax_output"]


@dataclass(frozen=True)
class ContextParallel:
    """How a context-parallel step finds the exact entmax threshold.

    Attributes:
        candidates: int >= 1, the m top scores per head each rank sends in the
            first collective (one gather of [B * HQ, m + 2] values).
        fallback_rounds: int >= 0, safeguarded Newton rounds (one all-reduce
            of [B * HQ, 2] each) for the heads whose union of top-m lists did
            not certify tau; a head that has not converged after them is
            reported inexact (``ShardStats.exact``).
        sync: bool. False (default): the fallback rounds always run, no
            host synchronisation (CUDA-graph capturable). True: one flag is
            read on the host after the first collective and the rounds run
            only when some head needs them.
    """

    candidates: int = 64
    fallback_rounds: int = 12
    sync: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidates", as_int(self.candidates, "ContextParallel.candidates", lo=1))
        object.__setattr__(self, "fallback_rounds",
                           as_int(self.fallback_rounds, "ContextParallel.fallback_rounds", lo=0))
        object.__setattr__(self, "sync", as_bool(self.sync, "ContextParallel.sync"))


# ------------------------------------------------------------------ collectives
def all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[ranks, *t.shape]: every rank's ``t`` (one collective, fixed size)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)


def all_sum(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` summed over the ranks, in place (one collective)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_max(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


class GroupPageSums(PageSums):
    """Reductions over a page axis split across the ranks of ``group``
    (``gaussian.solve_tau_hat``'s ``pages``): local reduction, then one
    all-reduce."""

    def __init__(self, group) -> None:
        self.group = group
        self.calls = 0  # collectives made

    def sum(self, x):
        self.calls += 1
        return all_sum(x.sum(-1).contiguous(), self.group)

    def max(self, x):
        self.calls += 1
        return all_max(x.amax(-1).contiguous(), self.group)

    def logsumexp(self, x):
        m = self.max(x)
        shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        return shift + torch.log(self.sum(torch.exp(x - shift.unsqueeze(-1))))


# ------------------------------------------------------------------ softmax
def merge_softmax(out: torch.Tensor, lse: torch.Tensor, empty: torch.Tensor, group) -> torch.Tensor:
    """Softmax over all ranks from each rank's (out [B, HQ, D], log-sum-exp
    [B, HQ]) over its kept tokens; ``empty`` [B, HQ]: the rank kept none.
    Two collectives (max, then the weighted sums). Returns float32 [B, HQ, D]."""
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse.float())
    top = all_max(lse.clone(), group)
    w = torch.exp(lse - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))  # 0 where empty
    acc = torch.cat((out.float() * w[..., None], w[..., None]), dim=-1)
    acc = all_sum(acc, group)
    den = acc[..., -1:]
    return torch.where(den > 0, acc[..., :-1] / den.clamp_min(1e-30), torch.zeros_like(acc[..., :-1]))


def softmax_lse(lse: torch.Tensor, empty: torch.Tensor, group) -> torch.Tensor:
    """The log-sum-exp over all ranks (for the statistics), one collective."""
    e = torch.where(empty, torch.full_like(lse, float("-inf")), lse.float())
    top = all_max(e.clone(), group)
    shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return shift + torch.log(all_sum(torch.exp(e - shift), group))


# ------------------------------------------------------------------ entmax
def entmax_tau(scores: torch.Tensor, lower: torch.Tensor, alpha: float, group,
               cfg: ContextParallel) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The exact threshold over every rank's candidates.

    Args:
        scores: float [R, C] this rank's candidate scores (score units, -inf
            padding): every kept token that can be in the support.
        lower: float [R]: this rank's unlisted kept tokens score below it (-inf: none).
        alpha: > 1.
    Returns:
        (tau float64 [R] in the units of ``entmax_threshold``, top float64
        [R] the largest score over all ranks (for ``entmax_output``), rounds
        int32 [R] of fallback Newton used (0: certified by the first
        collective), exact bool [R], collectives made).
    """
    a = alpha - 1.0
    beta = 1.0 / a
    R, C = scores.shape
    m = cfg.candidates
    x = scores.double()
    k = min(m + 1, C)
    top = x.topk(k, dim=-1).values if k > 0 else x.new_empty(R, 0)
    pad = x.new_full((R, m + 1 - k), float("-inf"))
    low = lower.double().clamp_min(torch.finfo(torch.float64).min)[:, None]
    sent = torch.cat((top, pad, low), dim=-1)  # [R, m + 2]
    got = all_gather(sent, group)  # [W, R, m + 2]
    union = got[:, :, :m].permute(1, 0, 2).reshape(R, -1)
    tau_u = entmax_threshold(union, alpha)[0].double()
    top_all = union.amax(-1)
    top_all = torch.where(torch.isfinite(top_all), top_all, torch.zeros_like(top_all))
    # the largest score any rank did not send, of its listed and its unlisted tokens
    unsent = torch.maximum(got[:, :, m], got[:, :, m + 1]).amax(0)
    ok = a * unsent <= tau_u
    rounds = torch.zeros(R, dtype=torch.int32, device=x.device)
    collectives = 1
    if cfg.fallback_rounds == 0 or (cfg.sync and bool(ok.all())):
        return tau_u, top_all, rounds, ok, collectives
    # Newton from below, in a frame shifted by the largest score (t in [-1, 0])
    shift = a * top_all
    lo = torch.maximum(tau_u, a * got[:, :, m + 1].amax(0)) - shift
    hi = torch.zeros_like(lo)
    t = lo.clone()
    xs = a * (x - top_all[:, None])  # -inf stays -inf
    done = ok.clone()
    for i in range(cfg.fallback_rounds):
        u = (xs - t[:, None]).clamp_min(0.0)
        on = u > 0
        f = torch.where(on, u.pow(beta), torch.zeros_like(u)).sum(-1)
        g = torch.where(on, u.pow(beta - 1.0), torch.zeros_like(u)).sum(-1)
        sums = all_sum(torch.stack((f, g), dim=-1), group)
        collectives += 1
        F, G = sums[:, 0] - 1.0, beta * sums[:, 1]
        lo = torch.where(F > 0, t, lo)
        hi = torch.where(F > 0, hi, t)
        step = t + F / G.clamp_min(1e-300)
        step = torch.where((step > lo) & (step < hi) & torch.isfinite(step), step, 0.5 * (lo + hi))
        conv = (F.abs() <= 1e-12) | ((hi - lo) <= 4e-16 * (1.0 + t.abs()))
        newly = conv & ~done
        rounds = torch.where(newly, torch.full_like(rounds, i + 1), rounds)
        done = done | conv
        t = torch.where(done, t, step)
        if cfg.sync and bool(done.all()):
            break
    tau = torch.where(ok, tau_u, t + shift)
    return tau, top_all, rounds, done, collectives


def entmax_output(scores: torch.Tensor, tokens: torch.Tensor, tau: torch.Tensor, top: torch.Tensor, alpha: float,
                  kv, kv_head, group, chunk: int = 4096) -> torch.Tensor:
    """sum_j p_j v_j over every rank's candidates at the global ``tau``.

    Args:
        scores: float [R, C] candidate scores (-inf padding); tokens: int64 [R, C],
            physical page * P + row; tau, top: float64 [R] (``entmax_tau``); kv: the rank's PagedKV;
        kv_head: int64 [R], the KV head each row reads.
    Returns float32 [R, D] (one all-reduce of [R, D + 1]): the output, the
    weights normalised by their global sum (1 at the exact tau).
    """
    a = alpha - 1.0
    beta = 1.0 / a
    R, C = scores.shape
    P, D = kv.page_size, kv.head_dim
    acc = torch.zeros(R, D + 1, dtype=torch.float64, device=scores.device)
    for c0 in range(0, C, chunk):  # bounded memory for the gathered V rows
        s = scores[:, c0:c0 + chunk].double()
        u = (a * (s - top[:, None]) - (tau - a * top)[:, None]).clamp_min(0.0)  # shifted: no cancellation
        p = torch.where(u > 0, u.pow(beta), torch.zeros_like(u))  # [R, c]
        tok = tokens[:, c0:c0 + chunk]
        v = kv.v_pages[tok // P, kv_head[:, None], tok % P].double()  # [R, c, D]
        acc[:, :D] += torch.einsum("rc,rcd->rd", p, v)
        acc[:, D] += p.sum(-1)
    acc = all_sum(acc, group)
    z = acc[:, D:]
    return torch.where(z > 0, acc[:, :D] / z.clamp_min(1e-300), torch.zeros_like(acc[:, :D])).float()

