"""Gaussian-aware page selection: page statistics, the tau_hat solve, the threshold test.

Reference: ``entmaxkv.policies.select`` with ``Gaussian`` (and
``entmaxkv.gaussian.solve_tau_hat``). Shapes: B batch, HQ query heads,
H KV heads, S selection heads, NG = HQ // S, M logical pages, P page size,
NCH page chunks of CH pages.

Model (docs/spec.md §5): a token score of page p is S_p ~ N(mu_p, sigma_p^2);
tau_hat solves F(tau) = sum_p n_p E[((alpha-1) S_p - tau)_+^beta] - 1 = 0, with
closed forms for beta = 1, 2, 3 (alpha = 2, 1.5, 4/3). Page p is kept when
(alpha-1) (mu_p + z_{n_p} sigma_p) > tau_hat - margin for any head of its
selection row, z_n = Phi^{-1}(q_max^(1/n)).

Launches (no host synchronisation, fixed count; launch.py runs them, plan.py
sizes them, moments.py holds the truncated moments and Halley steps):
1. ``_gauss_stats_kernel`` (B*H x NCS chunks of CHS <= CH pages): mu, sigma of
   every page and head (one read of k_mean / k_std, optionally prefetched
   one block ahead: GaussianConfig.stats_tune) plus per-chunk partials: token-weighted sums for the
   pooled Gaussian (shifted sums, accumulated per lane, one reduction per
   program) and the maxima that bracket tau_hat.
2. ``_gauss_start_kernel`` (B*HQ): the chunk partials merged in float64 into the
   bracket and the pooled moments; state 0 = the start (the bracket's left
   end under ALiBi, else the pooled-Gaussian solution; the policy's tau_hat
   when pooled) and the pooled solution.
3. ``_gauss_iter_kernel`` x nit (B*HQ x NCH): safeguarded Halley on log(F + 1),
   one launch per iteration. Launch 0 evaluates F, F', F'' at the start
   (under ALiBi at both points of state 0); later launches rebuild the same
   float64 iterate in every program of a head from the previous launch's
   partial sums (deterministic: same data, same order), then write their
   chunk's sums at the new iterate. Once a step moves tau by <= conv_tol
   (relative) the solve is final and the launches skip their pages.
   Skipped when pooled.
4. ``_gauss_select_kernel`` (B*S x blocks of at most sel_ch pages): final
   iterate, threshold test, forced pages, compaction with one atomic per
   block (pages unsorted).

Precision of the per-page terms (launch 3, the hot loop: up to nit x B*HQ*M pages).
They are float32, summed per lane in float32 over at most CH / BLOCK pages,
then across lanes and chunks in float64; the iterate and its bracket are
float64. tau_hat sits deep in the lower tail at long context (x = -mu_Y / s_Y
of 4-7 for most pages), where the textbook closed forms in Phi(t), phi(t)
cancel (relative error ~x^(k+1) eps) and (1 + erf) / 2 has no relative
accuracy: a plain float32 port is 6e-7 .. 1e-5 (relative) off in tau_hat,
which is why these were float64 (compute-bound: transcendentals in float64).
``moments._gauss_terms`` instead writes every moment as products and sums of positive
terms (``_mills``: a rational fit of the ratio E[(Z-x)+^3] / E[(Z-x)+^2] and
a backward recurrence, one exp and two divisions per page), relative error
about 5e-7 + 1e-7 x^2 against float64 (tests/kernels/test_gaussian_moments.py); tau_hat is
then within one float32 ulp of the float64 solve on the same page statistics.
The pooled solve (scalar) uses the same formulas in float64.
"""
from .launch import select_gaussian

__all__ = ["select_gaussian"]
