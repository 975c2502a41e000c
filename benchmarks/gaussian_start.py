"""Float64 replay of the Gaussian tau_hat solve's start (a script, not a test; CPU).

The kernels (``entmaxkv.kernels.gaussian``) run safeguarded Halley steps on
log(F + 1), one launch per step, and stop once a step moves tau by at most
CONV_TOL (relative). Launch 0 evaluates F either at two points (the
bracket's left end and the pooled-Gaussian start, then goes on from the one
nearer the root) or only at the pooled start. This script replays both in
float64 on synthetic page statistics and counts the steps each needs:

    PYTHONPATH=. python3 benchmarks/gaussian_start.py

Page scores: i.i.d. N(0, scale^2) tokens; "drift" adds a linear trend over the
context, "cluster" five pages 4 scales up, "sink" one page 8 scales up; ALiBi
subtracts slope * distance from every token. Pages of 16 tokens.
"""
from __future__ import annotations

import collections
import math

import torch

from entmaxkv.gaussian import _moments

CONV_TOL = 1e-4  # as entmaxkv.kernels.gaussian


def sums(m, s, w, tau, beta):
    """F + 1, F', F'' at tau for Y_p ~ N(m_p - tau, s_p^2) (beta = 1: the density term)."""
    e = _moments(m - tau, s, [beta, beta - 1, beta - 2] if beta > 1 else [beta, beta - 1])
    f = float((w * e[0]).sum())
    d1 = float(-beta * (w * e[1]).sum())
    if beta > 1:
        d2 = float(beta * (beta - 1) * (w * e[2]).sum())
    else:
        d2 = float((w * torch.exp(-0.5 * ((m - tau) / s) ** 2) / (s * math.sqrt(2 * math.pi))).sum())
    return f, d1, d2


def halley(sm, d1, d2, tau, lo, hi):
    """The kernels' _halley_update in float64 scalars."""
    if sm > 1.0:
        lo = tau
    else:
        hi = tau
    if sm <= 0 or d1 == 0:
        return 0.5 * (lo + hi), lo, hi, False
    g, g1 = math.log(sm), d1 / sm
    g2 = d2 / sm - g1 * g1
    step = g / g1
    L = step * g2 / g1
    L = 0.0 if L != L else max(-1.0, min(1.0, L))
    cand = tau - step / (1 - 0.5 * L)
    ok = lo <= cand <= hi
    return (cand if ok else 0.5 * (lo + hi)), lo, hi, ok


def pooled_start(m, s, w, beta, iters=8):
    """The pooled-Gaussian solution (the kernels' _pooled_tau start)."""
    n = float(w.sum())
    mg = float((w * m).sum()) / n
    sg = math.sqrt(float((w * (s * s + (m - mg) ** 2)).sum()) / n)
    lo, hi, tau = mg - 1.0, max(mg + 12 * sg, mg), mg - 1.0
    for _ in range(iters):
        f = sums(torch.tensor([mg]), torch.tensor([sg]), torch.tensor([n]), tau, beta)
        tau, lo, hi, _ = halley(*f, tau, lo, hi)
    return tau


def steps(m, s, w, beta, two: bool, max_steps: int = 40) -> int:
    """Halley steps until one moves tau by <= CONV_TOL (the launch that stops)."""
    lo = float(m.max()) - 1.0
    hi = max(float((m + 12 * s).max()), lo + 1.0)
    aux = pooled_start(m, s, w, beta)
    aux = min(max(aux, lo), hi) if aux == aux else lo
    if two:  # as _iterate: the pooled point's sign tightens the bracket; the nearer point is the base
        lo0 = lo
        fa, fb = sums(m, s, w, lo0, beta), sums(m, s, w, aux, beta)
        if fb[0] > 1:
            lo = aux
        else:
            hi = aux
        use_b = fb[0] > 0 and (fb[0] < fa[0] if fb[0] >= 1 else fa[0] * fb[0] > 1)
        f, tau = (fb, aux) if use_b else (fa, lo0)
    else:
        tau = aux
        f = sums(m, s, w, tau, beta)
    for it in range(1, max_steps):
        nxt, lo, hi, ok = halley(*f, tau, lo, hi)
        if ok and abs(nxt - tau) <= CONV_TOL * abs(nxt):
            return it
        tau = nxt
        f = sums(m, s, w, tau, beta)
    return max_steps


def pages(kind: str, n: int, slope: float, scale: float, P: int = 16, seed: int = 0):
    """Per-page (mu, sigma, tokens) of one synthetic row."""
    g = torch.Generator().manual_seed(seed)
    M = -(-n // P)
    w = torch.full((M,), float(P), dtype=torch.float64)
    w[-1] = n - (M - 1) * P
    x = torch.randn(M, P, generator=g, dtype=torch.float64) * scale
    if kind == "sink":
        x[0] += 8 * scale
    elif kind == "drift":
        x += torch.linspace(-2, 2, M, dtype=torch.float64)[:, None] * scale
    elif kind == "cluster":
        x[torch.randint(0, M, (5,), generator=g)] += 4 * scale
    pos = torch.arange(M * P, dtype=torch.float64).reshape(M, P)
    x = x - slope * (n - 1 - pos)
    keep = pos < n
    mu = (x * keep).sum(1) / w
    var = (((x - mu[:, None]) ** 2) * keep).sum(1) / w
    return mu, var.sqrt(), w


def main():
    table = collections.defaultdict(collections.Counter)
    worse = collections.Counter()
    for kind in ("iid", "drift", "cluster", "sink"):
        for n in (2000, 32000, 256000):
            for slope in (0.0, 2.0 ** -8, 2.0 ** -4, 2.0 ** -1):
                for scale in (0.5, 1.5, 4.0):
                    mu, sg, w = pages(kind, n, slope, scale, seed=n % 97)
                    for alpha in (2.0, 1.5, 4.0 / 3.0):
                        am1 = alpha - 1.0
                        two = steps(am1 * mu, am1 * sg, w, 1.0 / am1, True)
                        one = steps(am1 * mu, am1 * sg, w, 1.0 / am1, False)
                        group = "no slope" if slope == 0 else "ALiBi slopes"
                        table[group][(two, one)] += 1
                        worse[(group, one - two)] += 1
    print("steps to the stopping step: (two-point start, pooled start alone): cases")
    for group, cnt in table.items():
        print(f"  {group:12s}", ", ".join(f"{k}: {v}" for k, v in sorted(cnt.items())))
    print("extra steps of the pooled start alone: cases")
    for (group, d), v in sorted(worse.items()):
        print(f"  {group:12s} {d:+d}: {v}")


if __name__ == "__main__":
    main()
