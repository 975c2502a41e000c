"""Per-token key sketches: a safe score bound far tighter than a page's box.

A sketch describes each stored key k (of one layer and KV head) in a shared
basis fitted per (layer, KV head): a mean mu [D] and m orthonormal columns
Q [D, m] (the keys' leading principal directions). Per token it keeps m int8
codes c (z = Q^T (k - mu) ~ c * step) and two error radii, so that for every
query q (docs/spec.md §6)

    q.k <= q.mu + sum_i qa_i step_i c_i + |qa| eps_a + |q_perp| eps_b,
    qa = Q^T q,  q_perp = q - Q qa,

holds by construction: eps_a bounds |z - c * step| (plus the basis's
orthogonality defect times |z|), eps_b the residual |k - mu - Q z| off the
basis. A page's bound is the largest of its tokens' bounds (each with its
own ALiBi bias), so a page that holds only low-scoring keys is bounded
near its true maximum, where a box bound (Quest) overshoots by the sum of
per-coordinate extremes.

Storage per token: m int8 codes + 2 float16 radii (m + 4 bytes; 12 B at
m = 8, 9.4% of a float16 K+V row at D = 32). Radii are rounded up (toward
+inf) when stored, and computed with an allowance for float32 rounding, so
the bound stays safe whatever the cache dtype; a radius too large for
float16 becomes +inf (the page is then always kept).

Reference implementation (pure PyTorch); the Triton twins are
``entmaxkv.kernels.sketch``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ._checks import as_int, describe

__all__ = ["KeySketch", "fit_basis", "encode", "query_terms", "sketch_bounds", "page_box_bounds", "page_boxes",
           "write_sketch", "bytes_per_token", "CODE_MAX"]

CODE_MAX = 127
_U32 = 2.0 ** -24  # float32 unit roundoff


@dataclass(frozen=True)
class KeySketch:
    """The sketches of one layer's pages (tensors; the owner writes them).

    Shapes (N pages, H KV heads, P page size, D head dim, m sketch dims):

        mean    float32 [H, D]      mu per KV head
        basis   float32 [H, D, m]   Q per KV head (orthonormal columns)
        step    float32 [H, m]      code step per coordinate (> 0)
        defect  float32 [H]         |Q^T Q - I|_F of the stored basis, rounded up
        codes   int8    [N, H, P, m]
        radii   float16 [N, H, P, 2] (eps_a, eps_b), rounded up
        page_codes  int8    [N, H, 2, m]  (min, max) of the page's valid rows' codes
        page_radii  float16 [N, H, 2]     the largest eps_a, eps_b of its valid rows

    The page summaries (a box in the basis's coordinates) bound a page from
    20 bytes (m = 8) instead of P token sketches; the certified policy
    reads token sketches only for the pages they do not rule out.
    """

    mean: torch.Tensor
    basis: torch.Tensor
    step: torch.Tensor
    defect: torch.Tensor
    codes: torch.Tensor
    radii: torch.Tensor
    page_codes: torch.Tensor
    page_radii: torch.Tensor

    @property
    def dims(self) -> int:
        return self.basis.shape[2]

    @classmethod
    def empty(cls, num_pages: int, page_size: int, mean: torch.Tensor, basis: torch.Tensor,
              step: torch.Tensor) -> "KeySketch":
        """Zeroed codes and radii for ``num_pages`` pages under a basis
        (``fit_basis`` or the caller's: mean [H, D], basis [H, D, m] with
        orthonormal columns, step [H, m] > 0; any float dtype, same device)."""
        H, D, m = _check_basis(mean, basis, step)
        dev = mean.device
        b32 = basis.detach().to(torch.float32).contiguous()
        with torch.inference_mode(False):
            codes = torch.zeros(num_pages, H, page_size, m, dtype=torch.int8, device=dev)
            radii = torch.zeros(num_pages, H, page_size, 2, dtype=torch.float16, device=dev)
            page_codes = torch.zeros(num_pages, H, 2, m, dtype=torch.int8, device=dev)
            page_radii = torch.zeros(num_pages, H, 2, dtype=torch.float16, device=dev)
        return cls(mean.detach().to(torch.float32).contiguous(), b32, step.detach().to(torch.float32).contiguous(),
                   _defect(b32), codes, radii, page_codes, page_radii)


def _check_basis(mean, basis, step) -> Tuple[int, int, int]:
    if not isinstance(basis, torch.Tensor) or basis.dim() != 3 or not basis.is_floating_point():
        raise ValueError(f"basis: expected a float tensor [kv_heads, head_dim, dims], got {describe(basis)}")
    H, D, m = basis.shape
    if not 1 <= m <= D:
        raise ValueError(f"basis: expected 1 <= dims <= head_dim ({D}), got dims = {m}")
    if not isinstance(mean, torch.Tensor) or tuple(mean.shape) != (H, D) or not mean.is_floating_point() \
            or mean.device != basis.device:
        raise ValueError(f"mean: expected a float tensor [{H}, {D}] on {basis.device}, got {describe(mean)}")
    if not isinstance(step, torch.Tensor) or tuple(step.shape) != (H, m) or not step.is_floating_point() \
            or step.device != basis.device:
        raise ValueError(f"step: expected a float tensor [{H}, {m}] on {basis.device}, got {describe(step)}")
    if not bool(torch.isfinite(mean).all()) or not bool(torch.isfinite(basis).all()):
        raise ValueError("mean, basis: expected finite values")
    if not bool(((step > 0) & torch.isfinite(step)).all()):
        raise ValueError("step: expected finite values > 0")
    gram = basis.double().transpose(1, 2) @ basis.double()
    err = (gram - torch.eye(m, dtype=torch.float64, device=basis.device)).abs().amax()
    if float(err) > 1e-3:
        raise ValueError(f"basis: expected orthonormal columns (|Q^T Q - I| <= 1e-3), got {float(err):.3g}")
    return H, D, m


def _defect(basis32: torch.Tensor) -> torch.Tensor:
    """|Q^T Q - I|_F per head, float64 on the stored float32 basis, rounded up."""
    b = basis32.double()
    eye = torch.eye(b.shape[2], dtype=torch.float64, device=b.device)
    d = torch.linalg.matrix_norm(b.transpose(1, 2) @ b - eye)  # Frobenius >= spectral
    return _round_up(d * (1 + 1e-12) + 1e-30, torch.float32)


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 -> ``dtype`` rounded toward +inf (+inf beyond its range; NaN stays NaN)."""
    y = x.to(dtype)
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def fit_basis(keys: torch.Tensor, dims: int = 8) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean [H, D], basis [H, D, dims], step [H, dims]), float32, from keys
    [n, H, D] (any float dtype, n >= 1, finite): per KV head the mean, the
    ``dims`` leading principal directions (float64 eigendecomposition) and
    the step that maps the largest |coordinate| seen to CODE_MAX."""
    if not isinstance(keys, torch.Tensor) or keys.dim() != 3 or not keys.is_floating_point() or keys.shape[0] < 1:
        raise ValueError(f"keys: expected a float tensor [n >= 1, kv_heads, head_dim], got {describe(keys)}")
    D = keys.shape[2]
    dims = as_int(dims, "dims", lo=1, hi=D)
    k = keys.detach().double()
    if not bool(torch.isfinite(k).all()):
        raise ValueError("keys: expected finite values to fit a basis")
    mean = k.mean(0)  # [H, D]
    d = (k - mean).transpose(0, 1)  # [H, n, D]
    cov = d.transpose(1, 2) @ d / max(k.shape[0], 1)
    _, vecs = torch.linalg.eigh(cov)  # ascending
    basis = vecs.flip(-1)[..., :dims]  # [H, D, m]
    z = d @ basis  # [H, n, m]
    step = (z.abs().amax(1) / CODE_MAX).clamp(min=1e-6)
    return mean.float(), basis.float().contiguous(), step.float()


def encode(sk: KeySketch, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes int8 [T, H, m] and radii float16 [T, H, 2] of stored keys k
    [T, H, D] (the cache's storage dtype: the keys attention will read).

    Computed in float64 from the float32 basis; each radius gets the
    float32-rounding allowance the Triton twin needs (so both are safe and
    agree to a float16 step) and is rounded up. A non-finite key gives NaN
    radii (its bound is NaN: never certified).
    """
    mu, Q, step = sk.mean.double(), sk.basis.double(), sk.step.double()
    d = k.detach().double() - mu  # [T, H, D]
    z = torch.einsum("thd,hdm->thm", d, Q)
    codes = torch.round(z / step).clamp(-CODE_MAX, CODE_MAX)
    e_a = (z - codes * step).norm(dim=-1)
    r = d - torch.einsum("thm,hdm->thd", z, Q)
    e_b = r.norm(dim=-1)
    zn = z.norm(dim=-1)
    D, m = Q.shape[1], Q.shape[2]
    slack = _encode_slack(D, m) * (k.detach().double().norm(dim=-1) + mu.norm(dim=-1))
    eps_a = e_a + sk.defect.double() * zn + slack
    eps_b = e_b + slack
    codes = torch.where(torch.isfinite(codes), codes, torch.zeros_like(codes)).to(torch.int8)
    return codes, torch.stack((_round_up(eps_a, torch.float16), _round_up(eps_b, torch.float16)), -1)


def _encode_slack(D: int, m: int) -> float:
    """Relative allowance (times |k| + |mu|) for computing the radii in float32."""
    return 8.0 * (D + m + 4) * (m ** 0.5 + 1.0) * _U32


def page_boxes(codes: torch.Tensor, radii: torch.Tensor, valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Page summaries of token sketches codes [T, H, P, m] int8 and radii
    [T, H, P, 2] float16 over each page's first ``valid`` (int [T]) rows:
    (page_codes int8 [T, H, 2, m] = (min, max), page_radii float16 [T, H, 2]
    = the largest radii; NaN when a valid row's radius is NaN). A page with
    no valid row gets (CODE_MAX, -CODE_MAX) and zero radii (never read)."""
    T, H, P, m = codes.shape
    row_ok = (torch.arange(P, device=codes.device)[None, :] < valid.to(codes.device)[:, None])[:, None, :, None]
    c = codes.to(torch.int16)
    lo = torch.where(row_ok, c, torch.full_like(c, CODE_MAX)).amin(2)
    hi = torch.where(row_ok, c, torch.full_like(c, -CODE_MAX)).amax(2)
    r = torch.where(row_ok, radii, torch.zeros_like(radii)).amax(2)  # amax keeps NaN
    return torch.stack((lo, hi), 2).to(torch.int8), r


def write_sketch(sk: KeySketch, k_stored: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor) -> None:
    """Encode stored keys k_stored [T, H, D] and put them at (pages [T], rows [T])
    (int64, no padding), then refresh the summaries of the pages touched:
    the write paths call it after storing K. Each page's last written row is
    its last valid row (the write contract of entmaxkv.write)."""
    codes, radii = encode(sk, k_stored)
    sk.codes[pages, :, rows] = codes
    sk.radii[pages, :, rows] = radii
    touched, inverse = torch.unique(pages, return_inverse=True)
    valid = torch.zeros_like(touched).scatter_reduce(0, inverse, rows + 1, reduce="amax")
    box, rad = page_boxes(sk.codes[touched], sk.radii[touched], valid)
    sk.page_codes[touched] = box
    sk.page_radii[touched] = rad


def query_terms(q: torch.Tensor, sk: KeySketch, kv_heads: int):
    """What a query contributes to its sketch bounds, float32, from q [B, HQ, D]:
    [B, HQ, m + 4] holding w = qa * step (m values), qmu = q.mu, na = |qa|,
    nperp = |q_perp| and qn = |q| (the norms rounded up). Computed in
    float64 (a few flops per head); the bound's rounding allowance covers
    the cast to float32."""
    B, HQ, D = q.shape
    G = HQ // kv_heads
    qd = q.detach().double().view(B, kv_heads, G, D)
    Q = sk.basis.double()  # [H, D, m]
    qmu = torch.einsum("bhgd,hd->bhg", qd, sk.mean.double())
    qa = torch.einsum("bhgd,hdm->bhgm", qd, Q)
    perp = qd - torch.einsum("bhgm,hdm->bhgd", qa, Q)
    up = lambda x: _round_up(x * (1 + 1e-12), torch.float32)  # noqa: E731
    w = (qa * sk.step.double()[:, None, :]).float()
    norms = torch.stack((qmu.float(), up(qa.norm(dim=-1)), up(perp.norm(dim=-1)), up(qd.norm(dim=-1))), -1)
    return torch.cat((w, norms), -1).reshape(B, HQ, -1)


def _prepare(q, cache, seq_ids, layout):
    """Shared set-up: (sketch, layout, compute dtype, w [B, H, G, m], and the
    query terms [qmu, na, nperp, qn], each [B, H, G, 1, 1])."""
    from .scoring import _slopes, compute_dtype, page_layout

    sk = cache.sketch
    lay = layout if layout is not None else page_layout(cache, seq_ids)
    dt = compute_dtype(q)
    B, HQ, _ = q.shape
    H, m = cache.kv_heads, sk.dims
    G = HQ // H
    terms = query_terms(q, sk, H).to(dt).view(B, H, G, m + 4)
    norms = [terms[..., m + i][..., None, None] for i in range(4)]
    return sk, lay, dt, terms[..., :m], norms


def _safe(val, mag, knorm, bias, qn, sl, pos_q, *, scale, D, m, eps):
    """A bound's value (query . key bound, unscaled) made safe against the
    rounding of the bound (4 (m + 12) eps mag) and of the computed score it
    is compared with (4 (D + 4) eps (scale |q| |k|^ + |slope| (pos_q + 2)))."""
    score_slack = 4.0 * (D + 4) * eps * (scale * qn * knorm + sl.abs() * (pos_q + 2.0))
    return scale * (val + 4.0 * (m + 12) * eps * mag) + bias + score_slack


def sketch_bounds(q: torch.Tensor, cache, seq_ids: torch.Tensor, *, scale: float,
                  slopes: Optional[torch.Tensor] = None, layout=None) -> torch.Tensor:
    """Safe upper bound of every page's computed scores from its tokens' sketches.

    Token j of a page (codes c, radii eps_a, eps_b, position p_j):

        b_j = scale * (qmu + w.c + na eps_a + nperp eps_b) + slope (p_j - pos_q)

    bounds its exact score (module docstring). Two allowances make it safe
    against scores and thresholds computed in floating point (the
    certificate compares them directly, no further slack): the rounding of
    b_j itself, 4 (m + 12) eps (|qmu| + |w|.|c| + na eps_a + nperp eps_b)
    scale, and that of a computed score, 4 (D + 4) eps (scale |q| |k_j|^ +
    |slope| (pos_q + 2)) as in ``scoring.bound_slack``, with |k_j|^ =
    |mu| + (1 + defect) (|c * step| + eps_a) + eps_b >= |k_j|. A page's bound
    is the largest over its valid tokens.

    Args:
        q: [B, HQ, D]; cache: a PagedKVCache or layout.PagedKV whose
            ``sketch`` is set; seq_ids int [B]; scale > 0; slopes optional [HQ].
    Returns:
        float32 (float64 for float64 q) [B, HQ, M]; -inf past the end, NaN
        where a key was not finite.
    """
    from .scoring import _slopes

    sk, lay, dt, w, (qmu, na, nperp, qn) = _prepare(q, cache, seq_ids, layout)
    B, HQ, D = q.shape
    H, P, m = cache.kv_heads, cache.page_size, sk.dims
    codes = sk.codes[lay.phys].to(dt).permute(0, 2, 1, 3, 4)  # [B, H, M, P, m]
    radii = sk.radii[lay.phys].to(dt).permute(0, 2, 1, 3, 4)  # [B, H, M, P, 2]
    ea, eb = radii[..., 0][:, :, None], radii[..., 1][:, :, None]  # [B, H, 1, M, P]
    dot = torch.einsum("bhgm,bhnpm->bhgnp", w, codes)
    mag = torch.einsum("bhgm,bhnpm->bhgnp", w.abs(), codes.abs()) + qmu.abs() + na * ea + nperp * eb
    val = qmu + dot + na * ea + nperp * eb
    zq = (codes * sk.step.to(dt)[None, :, None, None, :]).norm(dim=-1)[:, :, None]  # |c * step|
    knorm = _key_norm(sk, dt, zq, ea, eb)
    sl = _slopes(slopes, HQ, val).view(1, H, HQ // H, 1, 1)
    pos_q = lay.pos_q.to(dt).view(B, 1, 1, 1, 1)
    pos = lay.first[:, :, None].to(dt) + torch.arange(P, device=val.device, dtype=dt)  # [B, M, P]
    bias = sl * (pos[:, None, None] - pos_q)
    tok = _safe(val, mag, knorm, bias, qn, sl, pos_q, scale=scale, D=D, m=m, eps=torch.finfo(dt).eps)
    row_ok = torch.arange(P, device=val.device)[None, None, :] < lay.n_tok[:, :, None]  # [B, M, P]
    tok = torch.where(row_ok[:, None, None], tok, torch.full_like(tok, float("-inf")))
    return tok.amax(-1).reshape(B, HQ, -1)  # amax keeps a NaN (a non-finite key)


def _key_norm(sk, dt, zq, ea, eb):
    """|mu| + (1 + defect) (|c * step| + eps_a) + eps_b, a bound on |k|."""
    H = sk.mean.shape[0]
    defect = sk.defect.to(dt).view(1, H, 1, 1, 1)
    return sk.mean.to(dt).norm(dim=-1).view(1, H, 1, 1, 1) + (1 + defect) * (zq + ea) + eb


def page_box_bounds(q: torch.Tensor, cache, seq_ids: torch.Tensor, *, scale: float,
                    slopes: Optional[torch.Tensor] = None, layout=None) -> torch.Tensor:
    """Safe upper bound of every page's computed scores from its summary
    (the box of its tokens' codes and its largest radii): the token bound
    of ``sketch_bounds`` maximised over that box,

        scale * (qmu + sum_i max(w_i lo_i, w_i hi_i) + na max eps_a
                 + nperp max eps_b) + the page's largest ALiBi bias,

    with the same allowances (|k|^ from the box). Looser than
    ``sketch_bounds`` but read from 2 m + 4 bytes per page and KV head.

    Args and returns: as ``sketch_bounds``.
    """
    from .scoring import _slopes

    sk, lay, dt, w, (qmu, na, nperp, qn) = _prepare(q, cache, seq_ids, layout)
    B, HQ, D = q.shape
    H, m = cache.kv_heads, sk.dims
    box = sk.page_codes[lay.phys].to(dt).permute(0, 2, 1, 3, 4)  # [B, H, M, 2, m]
    rad = sk.page_radii[lay.phys].to(dt).permute(0, 2, 1, 3)  # [B, H, M, 2]
    lo, hi = box[:, :, None, :, 0], box[:, :, None, :, 1]  # [B, H, 1, M, m]
    wq = w[:, :, :, None, :]  # [B, H, G, 1, m]
    best = torch.maximum(wq * lo, wq * hi).sum(-1)  # [B, H, G, M]
    top = torch.maximum(lo.abs(), hi.abs())
    ea, eb = rad[:, :, None, :, 0], rad[:, :, None, :, 1]  # [B, H, 1, M]
    q4 = [t[..., 0] for t in (qmu, na, nperp, qn)]  # [B, H, G, 1]
    mag = (wq.abs() * top).sum(-1) + q4[0].abs() + q4[1] * ea + q4[2] * eb
    val = q4[0] + best + q4[1] * ea + q4[2] * eb
    zq = (top * sk.step.to(dt)[None, :, None, None, :]).norm(dim=-1)  # [B, H, 1, M]
    knorm = _key_norm(sk, dt, zq[..., None], ea[..., None], eb[..., None])[..., 0]
    sl = _slopes(slopes, HQ, val).view(1, H, HQ // H, 1)
    pos_q = lay.pos_q.to(dt).view(B, 1, 1, 1)
    first = lay.first.to(dt)[:, None, None, :]  # [B, 1, 1, M]
    last = first + (lay.n_tok.to(dt)[:, None, None, :] - 1).clamp(min=0)
    bias = torch.maximum(sl * (first - pos_q), sl * (last - pos_q))
    page = _safe(val, mag, knorm, bias, q4[3], sl, pos_q, scale=scale, D=D, m=m, eps=torch.finfo(dt).eps)
    page = torch.where(lay.valid[:, None, None, :], page, torch.full_like(page, float("-inf")))
    return page.reshape(B, HQ, -1)


def bytes_per_token(dims: int) -> int:
    """Bytes of one token's sketch: int8 codes and two float16 radii."""
    return int(dims) + 4
