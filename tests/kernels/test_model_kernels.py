"""The decode step's fused elementwise kernels (entmaxkv/kernels/model.py)
against the model's PyTorch code (RMSNorm, rope_rotate, F.silu(gate) * up,
the residual add), and ModelStep's fused path against the unfused one.

Odd sizes (masks), 1 to 7 rows, float32 / float16 / bfloat16, fresh random
inputs. float32 results agree to a few ulp (the norm's summation order, the
last ulp of exp, cos, sin); float16 / bfloat16 ones to one ulp of the dtype
(those differences can flip a rounding); residual adds exactly. Each
comparison is also made against a perturbed reference, which must fail it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from entmaxkv import PagedKVCache  # noqa: E402
from entmaxkv.kernels import AttentionConfig, KernelConfig  # noqa: E402
from entmaxkv.kernels.model import add_rms_norm, rms_norm, rope_qk, silu_mul  # noqa: E402
from entmaxkv.model.lm import ModelConfig, RMSNorm, TransformerLM, rope_inv_freq, rope_rotate  # noqa: E402
from entmaxkv.model.step import ModelStep  # noqa: E402
from entmaxkv.policies import Full, TopK  # noqa: E402
from entmaxkv.testing import rel_err  # noqa: E402

# (the interpreter's exp of float32 overflows to inf for silu(-100), as CUDA's does, and numpy says so)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# |got - want| <= ATOL + RTOL |want|: a few float32 ulp, one ulp of a half type
RTOL = {torch.float32: 1e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def close(got: torch.Tensor, want: torch.Tensor, ulps: float = 1.0) -> bool:
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.double(), want.double()
    return bool(((g - w).abs() <= 1e-6 + ulps * RTOL[want.dtype] * w.abs()).all())


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def torch_norm(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = RMSNorm(r.shape[-1], eps)
    n.weight.data = weight
    with torch.no_grad():
        return n(r)


# ---------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 5, 33, 257, 8200])  # 8200: wider than a block, read in chunks
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_add_rms_norm_equals_torch(dtype, N, rows):
    g = gen(N * 10 + rows)
    shape = (rows, 1, N)  # the decode step's [B, 1, C]
    x, d = randn(shape, dtype, g, 3.0), randn(shape, dtype, g)
    w = randn((N,), dtype, g) + 1.0
    y, r = add_rms_norm(x, d, w, 1e-5)
    r_ref = x + d
    assert torch.equal(r, r_ref)  # rounded as torch's add, bit for bit
    want = torch_norm(r_ref, w, 1e-5)
    assert close(y, want)
    j = int(torch.randint(0, N, (1,), generator=g))
    w_bad = w.clone()
    w_bad[j] = w_bad[j] * 1.1
    assert not close(y, torch_norm(r_ref, w_bad, 1e-5))
    if N > 1:  # (one element normalises to +-weight, with or without delta)
        assert not close(y, torch_norm(x, w, 1e-5))
    # without delta: plain RMSNorm
    assert close(rms_norm(x, w, 1e-5), torch_norm(x, w, 1e-5))


@pytest.mark.parametrize("N", [7, 8200])
def test_add_rms_norm_outputs_and_layouts(N):
    """out / residual_out (in place over x too), keep_residual=False, a
    strided x, a float32 weight for a bfloat16 stream, a large eps."""
    g = gen(N)
    dtype = torch.bfloat16
    big = randn((3, N + 5), dtype, g, 2.0)
    x = big[:, 2:N + 2]  # rows N + 5 apart
    d = randn((3, N), dtype, g)
    w = randn((N,), torch.float32, g) + 1.0
    want_r = x + d
    want = torch_norm(want_r, w, 0.5)
    y, r = add_rms_norm(x, d, w, 0.5)
    assert torch.equal(r, want_r) and close(y, want)
    y2, none = add_rms_norm(x, d, w, 0.5, keep_residual=False)
    assert none is None and torch.equal(y2, y)
    out = torch.empty(3, N, dtype=dtype)
    x_copy = x.contiguous()
    y3, r3 = add_rms_norm(x_copy, d, w, 0.5, out=out, residual_out=x_copy)  # r written over x
    assert y3.data_ptr() == out.data_ptr() and r3.data_ptr() == x_copy.data_ptr()
    assert torch.equal(y3, y) and torch.equal(x_copy, want_r)
    res = torch.empty(3, N, dtype=dtype)
    y4, r4 = add_rms_norm(x, None, w, 0.5, residual_out=res)  # no delta: r is x, copied
    assert torch.equal(r4, x) and r4.data_ptr() == res.data_ptr() and close(y4, torch_norm(x, w, 0.5))
    y5, r5 = add_rms_norm(x, None, w, 0.5)
    assert r5 is x and torch.equal(y5, y4)


# ---------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 5, 33, 257, 1500])  # 1500: two programs a row
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_silu_mul_equals_torch(dtype, N, rows):
    g = gen(N * 10 + rows + 1)
    gate, up = randn((rows, 1, N), dtype, g, 4.0), randn((rows, 1, N), dtype, g)
    gate.view(-1)[0] = -100.0  # exp(100) overflows float32 in both: silu = -0
    got = silu_mul(gate, up)
    want = F.silu(gate) * up
    # silu rounded to the dtype, then the product: a flip of the first rounding (exp's last ulp) is
    # up to one ulp of the product, its own rounding another
    assert close(got, want, ulps=2)
    j = int(torch.randint(0, rows * N, (1,), generator=g))
    bad = gate.clone()
    bad.view(-1)[j] = 1.0 - 2.0 * bad.view(-1)[j]
    assert not close(got, F.silu(bad) * up, ulps=2)


def test_silu_mul_strided_rows_and_out():
    g = gen(11)
    both = randn((5, 2, 70), torch.float16, g, 3.0)  # gate and up interleaved by rows
    gate, up = both[:, 0], both[:, 1]
    out = torch.empty(5, 70, dtype=torch.float16)
    got = silu_mul(gate, up, out=out)
    assert got.data_ptr() == out.data_ptr() and close(got, F.silu(gate) * up, ulps=2)


# ---------------------------------------------------------------- RoPE
ROPE_CASES = [  # B, T, H, KV, D, max position
    (1, 1, 1, 1, 2, 10),
    (2, 1, 5, 1, 6, 100000),
    (3, 1, 4, 2, 34, 8192),  # D / 2 = 17: masked lanes
    (2, 3, 8, 8, 16, 500),  # T > 1
    (1, 2, 40, 8, 128, 4096),  # several head blocks of q, one of k
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_qk_equals_rope_rotate(dtype, case):
    B, T, H, KV, D, top = case
    g = gen(sum(case))
    qkv = randn((B, T, H + 2 * KV, D), dtype, g, 2.0)  # a fused projection's output: strided heads
    q, k = qkv[:, :, :H], qkv[:, :, H:H + KV]
    base = 500000.0 if D >= 128 else 10000.0
    inv = rope_inv_freq(D, base)
    for pos in (torch.randint(0, top, (B, T), generator=g), torch.randint(0, top, (T,), generator=g).int()):
        qo, ko = rope_qk(q, k, pos, inv)
        assert qo.is_contiguous() and ko.is_contiguous()
        qr, kr = rope_rotate(q, pos, base), rope_rotate(k, pos, base)
        # float32: cos / sin to the last ulp of angles up to ~1e5 rad
        tol = 4e-6 if dtype == torch.float32 else RTOL[dtype]
        for got, want in ((qo, qr), (ko, kr)):
            assert bool(((got.double() - want.double()).abs() <= tol * (1 + want.double().abs())).all())
        assert not close(qo, rope_rotate(q, pos + 1, base))
        assert not close(ko, rope_rotate(k, pos.flip(-1) if T > 1 else pos + 1, base))


# ---------------------------------------------------------------- arguments
def test_bad_arguments_are_named():
    x = torch.randn(2, 8)
    w = torch.ones(8)
    for call, name in [
        (lambda: add_rms_norm(x.long(), x, w, 1e-5), "x:"),
        (lambda: add_rms_norm(torch.randn(2, 0), None, torch.ones(0), 1e-5), "x:"),
        (lambda: add_rms_norm(torch.randn(8, 2).t(), None, w, 1e-5), "x:"),
        (lambda: add_rms_norm(x, x.half(), w, 1e-5), "delta:"),
        (lambda: add_rms_norm(x, x[:1], w, 1e-5), "delta:"),
        (lambda: add_rms_norm(x, x, torch.ones(7), 1e-5), "weight:"),
        (lambda: add_rms_norm(x, x, w.long(), 1e-5), "weight:"),
        (lambda: add_rms_norm(x, x, w, -1.0), "eps:"),
        (lambda: add_rms_norm(x, x, w, torch.tensor(1e-5)), "eps:"),
        (lambda: add_rms_norm(x, x, w, 1e-5, out=torch.empty(2, 8).half()), "out:"),
        (lambda: add_rms_norm(x, x, w, 1e-5, out=torch.empty(8, 2).t()), "out:"),
        (lambda: add_rms_norm(x, x, w, 1e-5, residual_out=torch.empty(3, 8)), "residual_out:"),
        (lambda: add_rms_norm(x, x, w, 1e-5, residual_out=x, keep_residual=False), "residual_out:"),
        (lambda: add_rms_norm(x, x, w, 1e-5, keep_residual=1), "keep_residual:"),
        (lambda: silu_mul(x.double(), x), "gate:"),
        (lambda: silu_mul(x, x[:, :4]), "up:"),
        (lambda: silu_mul(x, x, out=torch.empty(2, 7)), "out:"),
    ]:
        with pytest.raises(ValueError, match=name):
            call()
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 2, 8)
    pos, inv = torch.zeros(1, 1, dtype=torch.long), rope_inv_freq(8, 10000.0)
    for call, name in [
        (lambda: rope_qk(q[0], k, pos, inv), "q:"),
        (lambda: rope_qk(torch.randn(1, 1, 4, 7), k, pos, inv), "q:"),
        (lambda: rope_qk(torch.randn(1, 1, 8, 4).transpose(2, 3), k, pos, inv), "q:"),
        (lambda: rope_qk(q, k.long(), pos, inv), "k:"),
        (lambda: rope_qk(q, torch.randn(1, 1, 2, 6), pos, inv), "k:"),
        (lambda: rope_qk(q, torch.randn(2, 1, 2, 8), pos, inv), "k:"),
        (lambda: rope_qk(q, k, pos.float(), inv), "positions:"),
        (lambda: rope_qk(q, k, torch.zeros(1, 2, dtype=torch.long), inv), "positions:"),
        (lambda: rope_qk(q, k, [0], inv), "positions:"),
        (lambda: rope_qk(q, k, pos, inv.double()), "inv_freq:"),
        (lambda: rope_qk(q, k, pos, inv[:3]), "inv_freq:"),
    ]:
        with pytest.raises(ValueError, match=name):
            call()


# ---------------------------------------------------------------- ModelStep
def tiny(positions):
    """A 2-layer float32 model whose norms' weights differ (a norm fused
    with the wrong layer's weight would show) and whose attention is peaky."""
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                      attention="entmax", positions=positions)
    m = TransformerLM(cfg).eval()
    with torch.no_grad():
        for blk in m.blocks:
            blk.attn.wq.weight.mul_(6.0)
            blk.attn.wk.weight.mul_(6.0)
        for n in [m.norm, *(b.attn_norm for b in m.blocks), *(b.mlp_norm for b in m.blocks)]:
            n.weight.copy_(1.0 + 0.5 * torch.randn(cfg.d_model))
    return m


def stepped(m, fused, backend, steps=3, kernel_config=None, change=None):
    """Logits of ``steps`` decode steps of 2 rows (prompts of 13 tokens);
    ``change(m)``, when given, runs after the ModelStep is made and before
    the prefill."""
    cfg = m.cfg
    cache = PagedKVCache(40, 4, cfg.n_kv_heads, cfg.head_dim, max_seqs=2, max_pages_per_seq=20,
                         dtype=torch.float32, num_layers=cfg.n_layers)
    seqs = [cache.allocate(), cache.allocate()]
    run = ModelStep(m, cache, Full(), backend=backend, fused=fused, kernel_config=kernel_config)
    assert run.fused == fused
    if change is not None:
        change(m)
    m.prefill_paged(torch.randint(0, 96, (2, 13), generator=gen(2)), cache, seqs)
    toks = torch.randint(0, 96, (steps, 2), generator=gen(3))
    with torch.no_grad():
        return torch.stack([run.step(t, seqs).clone() for t in toks])


@pytest.mark.parametrize("positions", ["rope", "nape"])
def test_fused_step_equals_the_unfused_step(positions, launches):
    """ModelStep with the fused kernels (forced on, through the interpreter)
    gives the PyTorch step's logits to float32 rounding; every step launches
    one norm, then per layer the rotary (RoPE), the MLP norm, SwiGLU and
    the next norm."""
    m = tiny(positions)
    want = stepped(m, False, "reference")
    assert not launches.names()
    got = stepped(m, True, "triton")
    assert rel_err(got, want) < 1e-5
    assert rel_err(got[1:], want[:-1]) > 1e-2  # (steps differ: the comparison can fail)
    per_layer = ["_model_silu_mul_kernel", "_model_add_rms_norm_kernel"]
    per_layer = ["_model_rope_qk_kernel"] * (positions == "rope") + ["_model_add_rms_norm_kernel"] + per_layer
    step = ["_model_add_rms_norm_kernel"] + per_layer * m.cfg.n_layers
    assert [n for n in launches.names() if n.startswith("_model_")] == step * 3


def test_fused_step_packs_projections_and_follows_replaced_weights():
    """The fused step runs each layer's q|k|v and gate|up products from one
    packed matrix each, which the modules' weights view (a second step
    shares it); a weight replaced after the step was made is packed again
    at the next step: the logits are the unfused step's with the new weight."""
    m = tiny("rope")
    cfg = m.cfg
    cache = PagedKVCache(8, 4, cfg.n_kv_heads, cfg.head_dim, max_seqs=1, max_pages_per_seq=8,
                         dtype=torch.float32, num_layers=cfg.n_layers)
    first = ModelStep(m, cache, backend="triton", fused=True)
    for blk in m.blocks:
        for mods in ([blk.attn.wq, blk.attn.wk, blk.attn.wv], [blk.mlp.w_gate, blk.mlp.w_up]):
            assert len({mod.weight.untyped_storage().data_ptr() for mod in mods}) == 1
    second = ModelStep(m, cache, backend="triton", fused=True)
    assert second._packs[1][1].weight().data_ptr() == first._packs[1][1].weight().data_ptr()
    new = {"wv": torch.nn.Parameter(-1.5 * m.blocks[1].attn.wv.weight.detach()),
           "w_up": torch.nn.Parameter(0.5 * m.blocks[0].mlp.w_up.weight.detach())}

    def change(model):
        model.blocks[1].attn.wv.weight = torch.nn.Parameter(new["wv"].detach().clone())
        model.blocks[0].mlp.w_up.weight = torch.nn.Parameter(new["w_up"].detach().clone())

    want_old = stepped(m, False, "reference")
    got = stepped(m, True, "triton", change=change)
    want = stepped(m, False, "reference")  # m now has the new weights
    assert rel_err(got, want) < 1e-5
    assert rel_err(want_old, want) > 1e-2  # (the change shows: the comparison can fail)


def test_step_kernel_config_reaches_the_attention(launches):
    """ModelStep(kernel_config=...) runs the attention's launch variant
    (here the three-launch finish instead of _attn_finish_kernel), with the
    same logits; anything but a KernelConfig is refused by name."""
    m = tiny("nape")
    want = stepped(m, False, "triton")
    assert "_attn_finish_kernel" in launches.names() and "_attn_vacc_kernel" not in launches.names()
    del launches[:]
    got = stepped(m, False, "triton", kernel_config=KernelConfig(attention=AttentionConfig(finish=False)))
    assert "_attn_vacc_kernel" in launches.names() and "_attn_finish_kernel" not in launches.names()
    assert rel_err(got, want) < 1e-5
    cfg = m.cfg
    cache = PagedKVCache(8, 4, cfg.n_kv_heads, cfg.head_dim, max_seqs=1, max_pages_per_seq=8,
                         dtype=torch.float32, num_layers=cfg.n_layers)
    with pytest.raises(ValueError, match="kernel_config"):
        ModelStep(m, cache, kernel_config="attention.finish=False")


def test_fused_path_choice():
    """Off by default off CUDA; refused where the Triton backend does not run."""
    m = tiny("rope")
    cfg = m.cfg
    cache = PagedKVCache(8, 4, cfg.n_kv_heads, cfg.head_dim, max_seqs=1, max_pages_per_seq=8,
                         dtype=torch.float32, num_layers=cfg.n_layers)
    assert ModelStep(m, cache).fused is False
    assert ModelStep(m, cache, backend="triton").fused is False
    with pytest.raises(ValueError, match="fused:"):
        ModelStep(m, cache, backend="reference", fused=True)
    with pytest.raises(ValueError, match="fused:"):
        ModelStep(m, cache, TopK(8), fused="yes")
