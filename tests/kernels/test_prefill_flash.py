"""The fused causal prefill kernels (kernels/prefill/) against float64 references.

The reference is written here from the definitions (scores, ALiBi bias,
causal mask, then torch.softmax or the ``entmax`` package's bisection, an
implementation independent of this repository), in float64 on the inputs
as rounded to their dtype. Shapes are small: the kernels run on Triton's
CPU interpreter here (tests/conftest.py); tests/gpu/test_prefill_flash.py
runs long ones on the GPU.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton")
entmax_pkg = pytest.importorskip("entmax")

from entmaxkv.kernels.prefill import PrefillConfig, causal_attention  # noqa: E402
from entmaxkv.kernels.prefill.launch import causal_attention_passes  # noqa: E402
from entmaxkv.model.lm import causal_attention as model_attention  # noqa: E402
from entmaxkv.testing import DEVICE as DEV, KERNEL_TOL as TOL, alibi, rel_err  # noqa: E402

# The interpreter evaluates both sides of tl.where (e.g. inf - inf on masked lanes).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

# float32 inputs: the float32 kernel against the float64 solution (docs/limits.md's
# kernel tolerance, 2e-5, would also pass; these cases reach ~1e-6).
F32_TOL = 1e-5


def reference(q, k, v, alpha, scale, slopes=None, causal=True):
    """float64 causal attention of the last Tq of Tk positions, from the definitions."""
    B, H, Tq, D = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    G = H // KV
    qd = q.double()
    kd = k.double().repeat_interleave(G, dim=1)
    vd = v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("bhid,bhjd->bhij", qd, kd) * scale
    pos = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]
    j = torch.arange(Tk, device=q.device)[None, :]
    if slopes is not None:
        s = s + slopes.double().view(1, H, 1, 1) * (j - pos).double()
    if causal:
        s = s.masked_fill(j > pos, float("-inf"))
    if alpha == 1.0:
        p = torch.softmax(s, dim=-1)
    else:
        p = entmax_pkg.entmax_bisect(s, alpha=alpha, dim=-1, n_iter=80)
    return torch.einsum("bhij,bhjd->bhid", p, vd), p


def make(B, H, KV, Tq, Tk, D, dtype, seed, qscale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Tq, D, generator=gen) * qscale).to(dtype).to(DEV)
    k = torch.randn(B, KV, Tk, D, generator=gen).to(dtype).to(DEV)
    v = torch.randn(B, KV, Tk, D, generator=gen).to(dtype).to(DEV)
    return q, k, v


SLOPES = {
    "none": lambda H: None,
    "nape": lambda H: alibi(H, nape=True),  # half the heads with slope 0
    "all": lambda H: alibi(H, nape=False),
}

# (alpha, dtype, B, H, KV, Tq, Tk, D, slopes): every alpha meets odd lengths,
# chunks after context (Tq < Tk), GQA groups 1 / 2 / 4 and each slope kind;
# each dtype and head dim (16, 32, 24: padded to 32) appears several times.
CASES = [
    (1.0, torch.float32, 2, 2, 2, 33, 33, 16, "none"),
    (1.0, torch.float16, 1, 4, 1, 20, 70, 24, "nape"),
    (1.0, torch.bfloat16, 1, 4, 2, 7, 7, 32, "all"),
    (1.5, torch.float32, 1, 4, 2, 33, 33, 16, "nape"),
    (1.5, torch.float32, 2, 4, 1, 17, 70, 24, "all"),
    (1.5, torch.float16, 1, 2, 1, 1, 1, 32, "none"),
    (1.5, torch.bfloat16, 1, 4, 4, 30, 45, 16, "nape"),
    (2.0, torch.float32, 1, 4, 2, 70, 70, 32, "nape"),
    (2.0, torch.float16, 1, 2, 2, 5, 33, 24, "none"),
    (1.25, torch.float32, 1, 4, 1, 33, 40, 24, "all"),
    (1.25, torch.bfloat16, 1, 2, 1, 7, 7, 16, "none"),
    (3.0, torch.float32, 1, 4, 2, 25, 33, 16, "nape"),
    (3.0, torch.float16, 1, 2, 1, 3, 9, 32, "all"),
]


def _id(c):
    alpha, dtype, B, H, KV, Tq, Tk, D, sl = c
    return f"a{alpha}-{str(dtype)[6:]}-b{B}h{H}kv{KV}-q{Tq}k{Tk}-d{D}-{sl}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_reference(case):
    alpha, dtype, B, H, KV, Tq, Tk, D, sl = case
    q, k, v = make(B, H, KV, Tq, Tk, D, dtype, seed=CASES.index(case))
    slopes = SLOPES[sl](H)
    slopes = None if slopes is None else slopes.to(DEV)
    scale = 1.0 / math.sqrt(D)
    out = causal_attention(q, k, v, alpha=alpha, scale=scale, slopes=slopes)
    ref, p = reference(q, k, v, alpha, scale, slopes)
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    tol = F32_TOL if dtype == torch.float32 else TOL[dtype]
    err = rel_err(out, ref)
    assert err < tol, err
    # the comparison can fail: the other kind of attention, or dropping the mask
    # or the bias, is far from the kernel's answer
    other, _ = reference(q, k, v, 1.5 if alpha == 1.0 else 1.0, scale, slopes)
    wrong = [other]
    if Tk > 1:
        wrong.append(reference(q, k, v, alpha, scale, slopes, causal=False)[0])
    if slopes is not None:
        wrong.append(reference(q, k, v, alpha, scale, None)[0])
    if Tk > 1:
        assert min(rel_err(out, w) for w in wrong) > 5 * tol
    if alpha > 1.0 and Tk >= 33:  # entmax: the reference rows are sparse, the kernel's too
        assert (p == 0).double().mean() > 0.3


@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_whole_prompt_matches_the_model(alpha):
    """Tq == Tk: the same numbers as the model's own PyTorch attention
    (entmaxkv.model.lm.causal_attention) run in float64 with NAPE slopes and GQA."""
    q, k, v = make(1, 4, 2, 40, 40, 16, torch.float32, seed=7)
    slopes = alibi(4, nape=True).to(DEV)
    out = causal_attention(q, k, v, alpha=alpha, scale=0.25, slopes=slopes)
    want = model_attention(q.double(), k.double(), v.double(), alpha=alpha, scale=0.25, slopes=slopes)
    assert rel_err(out, want) < F32_TOL


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25])
def test_peaked_rows(alpha):
    """A large scale: each row's support is a handful of keys (checked on
    the reference), found by the seed: the first solve pass confirms it."""
    q, k, v = make(1, 2, 1, 40, 40, 32, torch.float32, seed=11)
    out, passes = causal_attention_passes(q, k, v, alpha=alpha, scale=2.0)
    ref, p = reference(q, k, v, alpha, 2.0)
    assert (p > 0).sum(-1).double().mean() < 3
    assert rel_err(out, ref) < F32_TOL
    assert int(passes.max()) <= (4 if alpha in (1.5, 2.0) else 5)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 1.25, 3.0])
def test_fused_output(alpha):
    """PrefillConfig.fuse_output: each row's output comes from the moments
    of the solve pass that finds its threshold (exact for alpha = 1.5, 2;
    first order otherwise), with GQA, ALiBi and a chunk after context."""
    q, k, v = make(1, 4, 2, 30, 50, 24, torch.float32, seed=12)
    slopes = alibi(4, nape=True).to(DEV)
    cfg = PrefillConfig(fuse_output=True)
    out, passes = causal_attention_passes(q, k, v, alpha=alpha, scale=0.3, slopes=slopes, config=cfg)
    ref, _ = reference(q, k, v, alpha, 0.3, slopes)
    assert rel_err(out, ref) < F32_TOL
    assert int(passes.min()) >= 2


def test_chunk_equals_rows_of_the_whole_prompt():
    """A chunk after cached context (Tq < Tk) gives the last Tq rows of the
    whole prompt's output, whatever the block alignment."""
    q, k, v = make(1, 4, 2, 45, 45, 16, torch.float32, seed=5)
    slopes = alibi(4, nape=True).to(DEV)
    for alpha in (1.0, 1.5):
        full = causal_attention(q, k, v, alpha=alpha, scale=0.3, slopes=slopes)
        for t in (1, 13, 30):
            part = causal_attention(q[:, :, -t:].contiguous(), k, v, alpha=alpha, scale=0.3, slopes=slopes)
            assert rel_err(part, full[:, :, -t:]) < 1e-6


def test_strided_inputs_and_out():
    """[B, T, H, D] storage viewed as [B, H, T, D] (any strides but the head
    dim's); ``out`` is written in place and the rows around it are untouched."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 21, 4, 16, generator=gen).transpose(1, 2)
    k = torch.randn(1, 30, 2, 16, generator=gen).transpose(1, 2)
    v = torch.randn(1, 30, 2, 16, generator=gen).transpose(1, 2)
    buf = torch.full((1, 4, 23, 16), float("nan"))
    out = buf[:, :, 1:22]
    res = causal_attention(q, k, v, alpha=1.5, scale=0.25, out=out)
    assert res.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    assert torch.isnan(buf[:, :, 0]).all() and torch.isnan(buf[:, :, 22]).all()
    ref, _ = reference(q, k, v, 1.5, 0.25)
    assert rel_err(out, ref) < F32_TOL


def test_config_changes_the_launch_not_the_answer():
    """Tiles, the ALiBi skip and the seed are launch choices: the output
    stays the reference's. Steep slopes make the skip drop most key blocks;
    without a seed the solve starts at the bracket's end and needs more passes."""
    q, k, v = make(1, 4, 2, 40, 64, 16, torch.float32, seed=9)
    slopes = torch.tensor([2.0, 0.5, 0.0, 1.0])
    for alpha in (1.0, 1.5):
        ref, _ = reference(q, k, v, alpha, 0.2, slopes)
        runs = {}
        for name, cfg in [("default", PrefillConfig()), ("tiles", PrefillConfig(block_m=32, block_n=16)),
                          ("noskip", PrefillConfig(alibi_skip=False)), ("noseed", PrefillConfig(seed_iters=0)),
                          ("fused", PrefillConfig(fuse_output=True))]:
            out, passes = causal_attention_passes(q, k, v, alpha=alpha, scale=0.2, slopes=slopes, config=cfg)
            assert rel_err(out, ref) < F32_TOL, name
            runs[name] = passes
        if alpha == 1.0:
            assert all(int(p.max()) == 1 for p in runs.values())
        else:  # max pass, solve passes, output pass (none when fused)
            assert int(runs["default"].min()) >= 3
            assert runs["noseed"].sum() > runs["default"].sum()
            assert torch.equal(runs["fused"], runs["default"] - 1)


def test_pass_cap_gives_a_finite_close_answer():
    """max_passes=1: every row takes the point after its first solve pass
    (no seed: far from the threshold); finite and close, if not exact."""
    q, k, v = make(1, 2, 1, 33, 33, 16, torch.float32, seed=4)
    ref, _ = reference(q, k, v, 1.25, 0.25)
    out, passes = causal_attention_passes(q, k, v, alpha=1.25, scale=0.25,
                                          config=PrefillConfig(max_passes=1, seed_iters=0))
    assert int(passes.max()) == 3 and torch.isfinite(out).all()
    assert rel_err(out, ref) < 0.2


def test_padding_rows_and_extreme_scores_stay_finite():
    """Tq not a multiple of block_m (padding lanes), tied scores (q = 0:
    every row flat) and huge scores: no NaN anywhere."""
    q, k, v = make(1, 2, 1, 17, 17, 16, torch.float32, seed=2)
    q[:, 0] = 0.0
    q[:, 1] *= 1e3
    for alpha in (1.0, 1.5, 2.0, 1.25, 3.0):
        out = causal_attention(q, k, v, alpha=alpha, scale=0.25)
        assert torch.isfinite(out).all(), alpha
        ref, _ = reference(q, k, v, alpha, 0.25)
        assert rel_err(out[:, 0], ref[:, 0]) < F32_TOL  # flat rows: the mean of the visible values


def test_empty_and_single_key():
    q, k, v = make(1, 2, 1, 0, 5, 16, torch.float32, seed=0)
    assert causal_attention(q, k, v, alpha=1.5, scale=1.0).shape == (1, 2, 0, 16)
    q, k, v = make(1, 2, 1, 1, 1, 16, torch.float16, seed=0)
    for alpha in (1.0, 1.5, 3.0):
        out = causal_attention(q, k, v, alpha=alpha, scale=1.0)
        assert torch.equal(out, v.expand(1, 2, 1, 16))


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


def _args():
    q, k, v = make(1, 4, 2, 8, 10, 16, torch.float32, seed=0)
    return dict(q=q, k=k, v=v, alpha=1.5, scale=0.25, slopes=torch.zeros(4), config=None, out=None)


BAD = [
    ("q", dict(q=torch.zeros(4, 8, 16))),
    ("q", dict(q=torch.zeros(1, 4, 8, 16, dtype=torch.float64))),
    ("q", dict(q=torch.zeros(1, 4, 8, 20))),
    ("q", dict(q=torch.zeros(1, 4, 8, 264))),
    ("q", dict(q=torch.zeros(1, 4, 16, 8).transpose(2, 3))),
    ("q", dict(q=torch.zeros(1, 4, 11, 16))),  # Tq > Tk
    ("k", dict(k=torch.zeros(1, 2, 10, 16, dtype=torch.float16))),
    ("k", dict(k=torch.zeros(2, 2, 10, 16))),
    ("k", dict(k=torch.zeros(1, 3, 10, 16))),
    ("k", dict(k=[[0.0]])),
    ("v", dict(v=torch.zeros(1, 2, 9, 16))),
    ("v", dict(v=torch.zeros(1, 2, 10, 16, dtype=torch.bfloat16))),
    ("alpha", dict(alpha=0.5)),
    ("alpha", dict(alpha=4.5)),
    ("alpha", dict(alpha=float("nan"))),
    ("alpha", dict(alpha=torch.tensor(1.5))),
    ("scale", dict(scale=0.0)),
    ("scale", dict(scale=-1.0)),
    ("scale", dict(scale=float("inf"))),
    ("scale", dict(scale="0.1")),
    ("slopes", dict(slopes=torch.zeros(3))),
    ("slopes", dict(slopes=torch.zeros(4, dtype=torch.int32))),
    ("slopes", dict(slopes=[0.0] * 4)),
    ("config", dict(config={"block_m": 16})),
    ("out", dict(out=torch.zeros(1, 4, 8, 8))),
    ("out", dict(out=torch.zeros(1, 4, 8, 16, dtype=torch.float16))),
]


@pytest.mark.parametrize("name,change", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_argument_is_named(name, change):
    args = _args()
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=rf"^{name}: expected"):
        causal_attention(q, k, v, **args)


def test_good_arguments_pass():
    args = _args()
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    assert causal_attention(q, k, v, **args).shape == q.shape


@pytest.mark.parametrize("field,value", [
    ("block_m", 24), ("block_m", 512), ("block_n", 8), ("num_warps", 3), ("num_stages", -1),
    ("max_passes", 0), ("tol", 0.0), ("tol", 0.5), ("seed_iters", 100), ("alibi_skip", 1),
    ("softmax_drop", 5.0), ("block_n", 32.0), ("fuse_output", "yes"),
])
def test_config_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: expected"):
        PrefillConfig(**{field: value})


def test_config_is_a_frozen_value():
    cfg = PrefillConfig(block_m=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_m = 64
    assert cfg == PrefillConfig(block_m=32) and hash(cfg) == hash(PrefillConfig(block_m=32))
