"""Bad input raises ValueError naming the argument and what was expected.

One table covers every public function and constructor of ``entmaxkv.__all__``
and of the README (decode, the policies, the entmax functions, the metrics,
the model's generation entry points): for each argument a few bad values, each
of which must raise ValueError whose message contains the argument's name.

Numbers follow one rule everywhere (entmaxkv/_checks.py): Python and NumPy
ints and floats are numbers, bool never is, tensors (0-d included) are not
accepted where a Python number is expected, NaN never passes and inf only
where a bound is open-ended by design (nowhere in this table).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import entmaxkv
from entmaxkv import (Certified, Decoder, Full, Gaussian, PagedKVCache, Selection, TopK, decode, dense_attention,
                      entmax_threshold, evaluate_selection)
from entmaxkv.entmax import entmax, entmax_from_tau, entmax15, sparsemax
from entmaxkv.metrics import quality
from entmaxkv.model.checkpoint import load_model
from entmaxkv.model.generate import DecodeSession, generate, make_policy, sample_next
from entmaxkv.model.lm import ModelConfig, TransformerLM
from entmaxkv.policies import check_policy
from entmaxkv.testing import random_cache

NAN, INF = math.nan, math.inf
CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "entmax"
# Bad values by the kind of argument (each also fails for a reason of its own
# kind: a string, None, a bool, a tensor, a list).
NOT_A_NUMBER = ["1", None, True, torch.tensor(1.0), [1.0], np.bool_(True)]
BAD_INT = NOT_A_NUMBER + [1.5, np.float64(2.0), NAN, INF]
BAD_FLOAT = NOT_A_NUMBER + [NAN]
BAD_BOOL = ["yes", 1, 0, None, 1.0]


def optional(values):
    """The bad values of an argument whose default is None (None is good there)."""
    return [v for v in values if v is not None]


@pytest.fixture(scope="module")
def small():
    cache, slots, _, _ = random_cache([20, 9], 2, 8, 4, seed=0)
    return cache, slots, torch.randn(2, 4, 8)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=48)).eval()


def _cases():
    """(id, call(small, model, bad), argument name, bad values)."""
    C = []

    def add(fn_name, arg, bad_values, call):
        C.append((f"{fn_name}:{arg}", call, arg, bad_values))

    # --- decode
    def dec(**kw):
        def call(s, m, bad):
            cache, slots, q = s
            args = dict(q=q, cache=cache, seq_ids=slots)
            args.update({k: (bad if v is ... else v) for k, v in kw.items()})
            return decode(**args)
        return call

    add("decode", "q", [None, [[1.0]], torch.randn(4, 8), torch.ones(2, 4, 8, dtype=torch.int32),
                        torch.full((2, 4, 8), NAN), torch.randn(2, 4, 7), torch.randn(2, 3, 8),
                        torch.randn(0, 4, 8)], dec(q=...))
    add("decode", "cache", [None, object(), "cache"], dec(cache=...))
    add("decode", "seq_ids", [None, 0, "01", [0.0, 1.0], [True, False], [0, 99], [0], [0, None],
                              torch.tensor([0.0, 1.0]), torch.tensor([[0, 1]]), np.array([0.0, 1.0])],
        dec(seq_ids=...))
    add("decode", "policy", ["topk", TopK, 3], dec(policy=...))
    add("decode", "alpha", BAD_FLOAT + [0.5, INF, -1.0, 0.0], dec(alpha=...))
    add("decode", "scale", optional(BAD_FLOAT) + [0.0, -1.0, INF], dec(scale=...))
    add("decode", "alibi_slopes", [torch.ones(3), [0.0] * 4, torch.full((4,), NAN),
                                   torch.ones(4, dtype=torch.int32), 0.5], dec(alibi_slopes=...))
    add("decode", "out", [torch.empty(2, 4, 7), torch.empty(2, 4, 8, dtype=torch.float64), [0.0]],
        dec(out=...))
    add("decode", "return_stats", BAD_BOOL, dec(return_stats=...))
    add("decode", "backend", ["cuda-magic", None, 1], dec(backend=...))
    add("decode", "check_finite", ["no", 1, 0], dec(check_finite=...))
    add("decode", "kernel_config", [3, "default", {}], dec(kernel_config=...))

    add("decode", "layer", BAD_INT + [1, -1], dec(layer=...))

    # --- the planned decoder
    def decoder(**kw):
        def call(s, m, bad):
            args = dict(q_heads=4, kv_heads=2, head_dim=8, page_size=4)
            args.update({k: (bad if v is ... else v) for k, v in kw.items()})
            return Decoder(**args)
        return call

    add("Decoder", "policy", ["topk", TopK, 3], decoder(policy=...))
    for arg in ("q_heads", "kv_heads", "head_dim"):
        add("Decoder", arg, BAD_INT + [0, -1], decoder(**{arg: ...}))
    add("Decoder", "page_size", BAD_INT + [0, 257], decoder(page_size=...))
    add("Decoder", "alpha", BAD_FLOAT + [0.5, INF], decoder(alpha=...))
    add("Decoder", "scale", optional(BAD_FLOAT) + [0.0, -1.0, INF], decoder(scale=...))
    add("Decoder", "alibi_slopes", [torch.ones(3), [0.0] * 4, torch.full((4,), NAN), torch.ones(4, dtype=torch.int32)],
        decoder(alibi_slopes=...))
    add("Decoder", "device", ["tpu", 3, "cuda:7"], decoder(device=...))
    add("Decoder", "backend", ["cuda-magic", None, 1], decoder(backend=...))
    add("Decoder", "kernel_config", [3, "default", {}], decoder(kernel_config=...))
    add("Decoder", "cuda_graphs", BAD_BOOL, decoder(cuda_graphs=...))

    def planned(s):
        cache, slots, q = s
        return Decoder(q_heads=4, kv_heads=2, head_dim=8, page_size=cache.page_size)

    def plan(**kw):
        def call(s, m, bad):
            cache, slots, q = s
            args = dict(block_table=cache.block_table, seq_lens=cache.seq_lens, seq_ids=slots)
            args.update({k: (bad if v is ... else v) for k, v in kw.items()})
            return planned(s).plan(**args)
        return call

    bt0 = torch.zeros(2, 5, dtype=torch.int32)
    add("Decoder.plan", "block_table", [None, bt0.long(), bt0.t(), bt0[None], bt0.float()], plan(block_table=...))
    add("Decoder.plan", "seq_lens", [None, torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
                                     torch.zeros(2, 1, dtype=torch.int32)], plan(seq_lens=...))
    add("Decoder.plan", "seq_ids", ["01", [0.0], [True], [99], [], [-1], torch.tensor([[0]]), torch.tensor([0.0])],
        plan(seq_ids=...))

    def run(**kw):
        def call(s, m, bad):
            cache, slots, q = s
            args = dict(q=q, kv=cache.layer(), out=None)
            args.update({k: (bad if v is ... else v) for k, v in kw.items()})
            return planned(s).plan_cache(cache, slots).run(**args)
        return call

    add("Decoder.run", "q", [None, torch.randn(2, 4, 7), torch.randn(1, 4, 8), torch.ones(2, 4, 8, dtype=torch.int32)],
        run(q=...))
    add("Decoder.run", "kv", [None, "kv", PagedKVCache(4, 8, 2, 8, max_seqs=1).layer()], run(kv=...))
    add("Decoder.run", "out", [torch.empty(2, 4, 7), torch.empty(2, 4, 8, dtype=torch.float64), [0.0]], run(out=...))
    add("Decoder.run", "return_stats", BAD_BOOL, run(return_stats=...))

    # --- policies (constructors)
    for cls in (Full, TopK, Gaussian, Certified):
        add(cls.__name__, "per_query_head", BAD_BOOL, lambda s, m, bad, c=cls: c(per_query_head=bad))
    for cls in (TopK, Gaussian, Certified):
        for arg in ("sinks", "window"):
            add(cls.__name__, arg, BAD_INT + [-1], lambda s, m, bad, c=cls, a=arg: c(**{a: bad}))
    add("TopK", "budget", BAD_INT + [0, -16], lambda s, m, bad: TopK(budget=bad))
    add("Gaussian", "q_max", BAD_FLOAT + ["0.9", 0.0, 1.0, 1.5, -0.1, INF], lambda s, m, bad: Gaussian(q_max=bad))
    add("Gaussian", "margin", BAD_FLOAT + [-1.0, INF], lambda s, m, bad: Gaussian(margin=bad))
    add("Gaussian", "pooled", BAD_BOOL, lambda s, m, bad: Gaussian(pooled=bad))
    add("Certified", "dense_above", BAD_FLOAT + [0.0, -0.5, 1.5, INF], lambda s, m, bad: Certified(dense_above=bad))
    add("Certified", "probe_every", BAD_INT + [0, -1], lambda s, m, bad: Certified(probe_every=bad))
    add("Certified", "seed", [None, Full(), Certified(), "topk", 1024], lambda s, m, bad: Certified(seed=bad))
    # --- check_policy: what depends on the cache and alpha
    add("check_policy", "budget", [TopK(8), Certified(seed=TopK(8))],
        lambda s, m, bad: check_policy(bad, alpha=1.5, page_size=16))
    add("check_policy", "alpha", [Gaussian(), Certified()],
        lambda s, m, bad: check_policy(bad, alpha=1.0, page_size=16))
    add("check_policy", "page_size", BAD_INT + [0], lambda s, m, bad: check_policy(TopK(64), alpha=1.5, page_size=bad))
    add("check_policy", "alpha", BAD_FLOAT + [0.5], lambda s, m, bad: check_policy(TopK(64), alpha=bad, page_size=16))
    add("check_policy", "policy", [None, "full", TopK], lambda s, m, bad: check_policy(bad, alpha=1.5, page_size=16))

    # --- entmax functions
    x = torch.randn(3, 5)
    for fn in (entmax, entmax_threshold, entmaxkv.alpha_entmax):
        name = getattr(fn, "__name__", "entmax")
        add(name, "x", [None, [[1.0, 2.0]], torch.ones(3, 5, dtype=torch.int64)], lambda s, m, bad, f=fn: f(bad, 1.5))
        add(name, "alpha", BAD_FLOAT + [0.5, INF, "1.5"], lambda s, m, bad, f=fn: f(x, bad))
        add(name, "dim", BAD_INT + [2, -3], lambda s, m, bad, f=fn: f(x, 1.5, bad))
    add("entmax_threshold", "tau_init", [torch.zeros(5), torch.zeros(3, 1), [0.0] * 3, 0.0],
        lambda s, m, bad: entmax_threshold(x, 1.7, -1, bad))
    add("entmax_from_tau", "x", [None, [1.0]], lambda s, m, bad: entmax_from_tau(bad, torch.zeros(3), 1.5))
    add("entmax_from_tau", "tau", [None, 0.0, torch.zeros(5), torch.zeros(3, 2)],
        lambda s, m, bad: entmax_from_tau(x, bad, 1.5))
    add("entmax_from_tau", "alpha", BAD_FLOAT + [0.5], lambda s, m, bad: entmax_from_tau(x, torch.zeros(3), bad))
    add("entmax_from_tau", "dim", BAD_INT + [5], lambda s, m, bad: entmax_from_tau(x, torch.zeros(3), 1.5, bad))
    for fn in (sparsemax, entmax15):
        add(fn.__name__, "x", [None, [1.0]], lambda s, m, bad, f=fn: f(bad))
        add(fn.__name__, "dim", BAD_INT + [2], lambda s, m, bad, f=fn: f(x, bad))

    # --- metrics
    qd, kd, vd = torch.randn(4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)

    def dense(**kw):
        def call(s, m, bad):
            args = dict(q=qd, k=kd, v=vd, alpha=1.5, scale=0.3)
            args.update({k: (bad if v is ... else v) for k, v in kw.items()})
            return dense_attention(**args)
        return call

    add("dense_attention", "q", [None, torch.randn(2, 4, 8), torch.randn(4, 7), torch.randn(3, 8),
                                 torch.ones(4, 8, dtype=torch.int32)], dense(q=...))
    add("dense_attention", "k", [None, torch.randn(10, 8), torch.randn(10, 3, 8), torch.randn(0, 2, 8)], dense(k=...))
    add("dense_attention", "v", [None, torch.randn(9, 2, 8), torch.randn(10, 2, 4)], dense(v=...))
    add("dense_attention", "alpha", BAD_FLOAT + [0.5, 4.5], dense(alpha=...))
    add("dense_attention", "scale", BAD_FLOAT + [0.0, -1.0, INF], dense(scale=...))
    add("dense_attention", "slopes", [torch.ones(3), [0.0] * 4, torch.ones(4, dtype=torch.int64)], dense(slopes=...))
    add("dense_attention", "length", optional(BAD_INT) + [0, 11, -1], dense(length=...))

    def evals(**kw):
        def call(s, m, bad):
            cache, slots, q = s
            sel = Selection(torch.zeros(2, 2, cache.max_pages_per_seq, dtype=torch.int32),
                            torch.ones(2, 2, dtype=torch.int32))
            args = dict(q=q, cache=cache, seq_ids=slots, sel=sel, out_sparse=torch.zeros(2, 4, 8),
                        alpha=1.5, scale=0.3)
            args.update({k: (bad if v is ... else v) for k, v in kw.items()})
            return evaluate_selection(**args)
        return call

    add("evaluate_selection", "q", [None, torch.randn(4, 8), torch.randn(2, 4, 7)], evals(q=...))
    add("evaluate_selection", "cache", [None, object()], evals(cache=...))
    add("evaluate_selection", "seq_ids", [None, [0], [0, 99], "01", [0.5, 1]], evals(seq_ids=...))
    add("evaluate_selection", "sel", [None, "sel", Selection(torch.zeros(1, 2, 3, dtype=torch.int32),
                                                             torch.ones(1, 2, dtype=torch.int32))], evals(sel=...))
    add("evaluate_selection", "out_sparse", [None, torch.zeros(2, 4, 7), torch.zeros(1, 4, 8)], evals(out_sparse=...))
    add("evaluate_selection", "alpha", BAD_FLOAT + [0.5], evals(alpha=...))
    add("evaluate_selection", "scale", BAD_FLOAT + [0.0], evals(scale=...))
    add("evaluate_selection", "slopes", [torch.ones(3), [0.0] * 4], evals(slopes=...))

    p_full, o_full, kept, o_sp = torch.full((4, 10), 0.1), torch.randn(4, 8), torch.ones(4, 10, dtype=torch.bool), torch.randn(4, 8)
    add("quality", "p_full", [None, torch.ones(4)], lambda s, m, bad: quality(bad, o_full, kept, o_sp))
    add("quality", "out_full", [None, torch.ones(3, 8)], lambda s, m, bad: quality(p_full, bad, kept, o_sp))
    add("quality", "kept", [None, torch.ones(4, 9, dtype=torch.bool), torch.ones(4, 10)],
        lambda s, m, bad: quality(p_full, o_full, bad, o_sp))
    add("quality", "out_sparse", [None, torch.ones(4, 7)], lambda s, m, bad: quality(p_full, o_full, kept, bad))

    # --- CSR page tables
    bt, sl, i32 = torch.zeros(2, 5, dtype=torch.int32), torch.full((2,), 7, dtype=torch.int32), torch.int32
    ptr, idx, csel = torch.tensor([0, 2, 3], dtype=i32), torch.zeros(6, dtype=i32), Selection(
        torch.zeros(2, 2, 3, dtype=i32), torch.ones(2, 2, dtype=i32))
    bad_bt, bad_vec = [None, [[0]], bt.long(), bt[0]], [None, [7, 7], sl.long(), sl[:1], sl[None]]
    add("block_table_to_csr", "block_table", bad_bt, lambda s, m, bad: entmaxkv.block_table_to_csr(bad, sl, 4))
    add("block_table_to_csr", "seq_lens", bad_vec, lambda s, m, bad: entmaxkv.block_table_to_csr(bt, bad, 4))
    add("block_table_to_csr", "page_size", BAD_INT + [0], lambda s, m, bad: entmaxkv.block_table_to_csr(bt, sl, bad))
    add("block_table_to_csr", "capacity", optional(BAD_INT) + [-1],
        lambda s, m, bad: entmaxkv.block_table_to_csr(bt, sl, 4, capacity=bad))
    c2b = entmaxkv.csr_to_block_table
    add("csr_to_block_table", "indptr", [None, ptr.long(), ptr[:0], ptr[None]], lambda s, m, bad: c2b(bad, idx, sl, 4, max_pages=5))
    add("csr_to_block_table", "indices", [None, idx.long(), idx[None]], lambda s, m, bad: c2b(ptr, bad, sl, 4, max_pages=5))
    add("csr_to_block_table", "last_page_len", bad_vec, lambda s, m, bad: c2b(ptr, idx, bad, 4, max_pages=5))
    add("csr_to_block_table", "page_size", BAD_INT + [0], lambda s, m, bad: c2b(ptr, idx, sl, bad, max_pages=5))
    add("csr_to_block_table", "max_pages", BAD_INT + [-1], lambda s, m, bad: c2b(ptr, idx, sl, 4, max_pages=bad))
    s2c = entmaxkv.selection_to_csr
    add("selection_to_csr", "sel", [None, (csel.pages, csel.counts), Selection(csel.pages[:1], csel.counts[:1]),
                                    Selection(csel.pages, csel.counts.long())], lambda s, m, bad: s2c(bad, bt, sl, 4))
    add("selection_to_csr", "block_table", bad_bt, lambda s, m, bad: s2c(csel, bad, sl, 4))
    add("selection_to_csr", "seq_lens", bad_vec, lambda s, m, bad: s2c(csel, bt, bad, 4))
    add("selection_to_csr", "page_size", BAD_INT + [0], lambda s, m, bad: s2c(csel, bt, sl, bad))
    add("selection_to_csr", "capacity", optional(BAD_INT) + [-1], lambda s, m, bad: s2c(csel, bt, sl, 4, capacity=bad))
    add("selection_to_csr", "return_logical", BAD_BOOL, lambda s, m, bad: s2c(csel, bt, sl, 4, return_logical=bad))

    # --- model entry points
    prompt = torch.tensor([[1, 2, 3]])

    def gen(**kw):
        def call(s, m, bad):
            args = dict(model=m, prompt=prompt, max_new_tokens=2)
            args.update({k: (bad if v is ... else v) for k, v in kw.items()})
            return generate(**args)
        return call

    add("generate", "model", [None, "model"], gen(model=...))
    add("generate", "prompt", [None, "abc", torch.zeros(1, 0, dtype=torch.long), torch.tensor([[1.5]]),
                               torch.tensor([[300]]), torch.tensor([[-1]]), torch.zeros(1, 1, 1, dtype=torch.long)],
        gen(prompt=...))
    add("generate", "max_new_tokens", BAD_INT + [0, -1], gen(max_new_tokens=...))
    add("generate", "temperature", BAD_FLOAT + [-1.0, INF], gen(temperature=...))
    add("generate", "top_k", BAD_INT + [-1], gen(top_k=...))
    add("generate", "top_p", BAD_FLOAT + [0.0, -0.5, 1.5, INF], gen(top_p=...))
    add("generate", "seed", BAD_INT + [-1], gen(seed=...))
    add("generate", "page_size", BAD_INT + [0, -1], gen(page_size=...))
    add("generate", "cache_dtype", ["float16", torch.int32, 16], gen(cache_dtype=...))
    add("generate", "backend", ["gpu", None, 1], gen(backend=...))
    add("generate", "policy", ["topk", TopK, 3], gen(policy=...))
    add("generate", "keep_logits", BAD_BOOL, gen(keep_logits=...))
    add("generate", "return_stats", BAD_BOOL, gen(return_stats=...))
    add("generate", "stop_token", ["a", 1.5, -1, 256, True], gen(stop_token=...))
    add("generate", "cuda_graph", BAD_BOOL, gen(cuda_graph=...))
    add("generate", "prefill_chunk", optional(BAD_INT) + [0, -1], gen(prefill_chunk=...))

    logits = torch.randn(2, 16)
    add("sample_next", "logits", [None, torch.randn(16), torch.ones(2, 16, dtype=torch.long)],
        lambda s, m, bad: sample_next(bad, temperature=1.0))
    add("sample_next", "temperature", BAD_FLOAT + [-1.0, INF], lambda s, m, bad: sample_next(logits, temperature=bad))
    add("sample_next", "top_k", BAD_INT + [-1], lambda s, m, bad: sample_next(logits, temperature=1.0, top_k=bad))
    add("sample_next", "top_p", BAD_FLOAT + [0.0, 1.5], lambda s, m, bad: sample_next(logits, temperature=1.0, top_p=bad))
    add("sample_next", "generator", ["gen", 0], lambda s, m, bad: sample_next(logits, temperature=1.0, generator=bad))

    add("make_policy", "name", ["dense", None, 1], lambda s, m, bad: make_policy(bad))
    add("make_policy", "budget", BAD_INT + [0], lambda s, m, bad: make_policy("topk", budget=bad))
    add("make_policy", "q_max", BAD_FLOAT + [1.0], lambda s, m, bad: make_policy("gaussian", q_max=bad))
    add("make_policy", "margin", BAD_FLOAT + [-1.0], lambda s, m, bad: make_policy("gaussian", margin=bad))
    add("make_policy", "seed_budget", optional(BAD_INT) + [0], lambda s, m, bad: make_policy("certified", seed_budget=bad))

    def sess(**kw):
        def call(s, m, bad):
            args = dict(model=m, batch=1, max_len=8)
            args.update({k: (bad if v is ... else v) for k, v in kw.items()})
            return DecodeSession(**args)
        return call

    add("DecodeSession", "model", [None, "m"], sess(model=...))
    for arg in ("batch", "max_len", "page_size", "copies"):
        add("DecodeSession", arg, BAD_INT + [0, -1], sess(**{arg: ...}))
    add("DecodeSession", "cache_dtype", ["float32", torch.int64], sess(cache_dtype=...))
    add("DecodeSession", "backend", ["gpu", None], sess(backend=...))
    add("DecodeSession.prefill", "tokens", [None, torch.zeros(2, 3, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long),
                                            torch.zeros(1, 3)],
        lambda s, m, bad: DecodeSession(m, 1, 8).prefill(bad))
    add("DecodeSession.step", "tokens", [None, torch.zeros(2, dtype=torch.long), torch.zeros(1)],
        lambda s, m, bad: DecodeSession(m, 1, 8).step(bad, Full()))
    add("DecodeSession.step", "copy", BAD_INT + [1, -1],
        lambda s, m, bad: DecodeSession(m, 1, 8).step(torch.zeros(1, dtype=torch.long), Full(), copy=bad))

    for arg in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "train_context"):
        add("ModelConfig", arg, BAD_INT + [0, -1], lambda s, m, bad, a=arg: ModelConfig(**{a: bad}))
    for arg, extra in (("rope_base", [0.0, INF]), ("norm_eps", [0.0, -1e-5]), ("init_std", [0.0, INF])):
        add("ModelConfig", arg, BAD_FLOAT + extra, lambda s, m, bad, a=arg: ModelConfig(**{a: bad}))
    add("ModelConfig", "alpha", BAD_FLOAT + [1.0, 0.5, INF], lambda s, m, bad: ModelConfig(alpha=bad))
    add("ModelConfig", "attention", ["linear", None], lambda s, m, bad: ModelConfig(attention=bad))
    add("ModelConfig", "positions", ["sinusoidal", None], lambda s, m, bad: ModelConfig(positions=bad))
    add("ModelConfig", "n_kv_heads", [3, 16], lambda s, m, bad: ModelConfig(n_heads=8, n_kv_heads=bad))
    add("ModelConfig", "n_heads", [6, 7], lambda s, m, bad: ModelConfig(d_model=256, n_heads=bad, n_kv_heads=1))
    add("load_model", "path", ["/nonexistent/model", None, 3], lambda s, m, bad: load_model(bad))
    add("load_model", "dtype", ["float32", torch.int32], lambda s, m, bad: load_model(CHECKPOINT, dtype=bad))
    return C


CASES = [(cid, call, arg, bad) for cid, call, arg, bads in _cases() for bad in bads]


def _bad_id(bad) -> str:
    if isinstance(bad, torch.Tensor):
        return f"tensor{tuple(bad.shape)}{str(bad.dtype)[6:]}"
    return type(bad).__name__ + ":" + repr(bad)[:20]


@pytest.mark.parametrize("call,arg,bad", [c[1:] for c in CASES],
                         ids=[f"{c[0]}={_bad_id(c[3])}" for c in CASES])
def test_bad_argument_raises_value_error_naming_it(small, model, call, arg, bad):
    with pytest.raises(ValueError) as err:
        call(small, model, bad)
    msg = str(err.value)
    assert arg in msg, f"{msg!r} does not name {arg!r}"
    assert any(w in msg for w in ("expected", "must", "not", "needs")), f"{msg!r} does not say what was expected"


def test_the_table_covers_every_public_name():
    """Every callable of entmaxkv.__all__ that takes arguments has rows above
    (the exceptions and output records are not called by users with input)."""
    covered = {cid.split(":")[0] for cid, _, _, _ in _cases()}
    outputs = {"CacheFullError", "DecodeStats", "Quality", "Selection", "PagedKVCache"}
    # PagedKVCache's arguments are covered by tests/test_cache.py.
    for name in set(entmaxkv.__all__) - outputs:
        fn = getattr(entmaxkv, name)
        assert getattr(fn, "__name__", name) in covered or name in covered, name


# ---------------------------------------------------------------- numbers are numbers


def test_numpy_numbers_are_accepted_like_python_numbers(small):
    cache, slots, q = small
    ref = decode(q, cache, slots, TopK(32, sinks=1), alpha=1.5, scale=0.3)
    for alpha in (np.float32(1.5), np.float64(1.5), np.float16(1.5)):
        got = decode(q, cache, np.array(slots), TopK(np.int64(32), sinks=np.int32(1)), alpha=alpha,
                     scale=np.float32(0.3))
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert decode(q, cache, [np.int64(s) for s in slots], alpha=np.int64(2)).shape == q.shape
    g = Gaussian(q_max=np.float32(0.99), margin=np.float64(0.1), pooled=np.bool_(True))
    decode(q, cache, slots, g)
    # the policies store plain Python values, so they compare and hash like their twins
    assert TopK(np.int64(32)) == TopK(32) and type(TopK(np.int64(32)).budget) is int
    assert hash(Gaussian(q_max=np.float32(0.5))) == hash(Gaussian(q_max=0.5))
    assert type(Gaussian(pooled=np.bool_(True)).pooled) is bool
    p = entmax(torch.randn(2, 5), np.float32(1.5))
    torch.testing.assert_close(p.sum(-1), torch.ones(2))


def test_integral_floats_are_not_ints():
    with pytest.raises(ValueError, match="budget"):
        TopK(1024.0)


# ---------------------------------------------------------------- behaviour kept


def test_bad_sequences_messages(small):
    cache, slots, q = small
    with pytest.raises(ValueError, match="seq_ids"):
        decode(q, cache, [slots[0], 99])
    with pytest.raises(ValueError, match="seq_ids"):
        decode(q, cache, [slots[0]])
    cache2, slots2, _, _ = random_cache([20, 9], 2, 8, 4, seed=0)
    cache2.free(slots2[1])
    with pytest.raises(ValueError, match="not allocated"):
        decode(q, cache2, slots2)
    empty = cache2.allocate()
    with pytest.raises(ValueError, match="empty"):
        decode(q, cache2, [slots2[0], empty])


def test_check_policy_still_validates_a_policy_built_around_the_constructor():
    # A frozen policy whose field was overwritten after construction is
    # still checked where it is used.
    pol = TopK(64)
    object.__setattr__(pol, "budget", "64")
    with pytest.raises(ValueError, match="budget"):
        check_policy(pol, alpha=1.5, page_size=4)


def test_valid_edge_values_pass(small):
    cache, slots, q = small
    decode(q, cache, slots, alpha=1.0)  # softmax
    decode(q, cache, slots, TopK(4), alpha=1)  # budget == page_size; int alpha
    decode(q, cache, slots, check_finite=False, return_stats=np.bool_(False))
    sample_next(torch.randn(2, 16), temperature=0.0)  # greedy
    sample_next(torch.randn(2, 16), temperature=1.0, top_k=0, top_p=1.0)
    assert entmax(torch.randn(3, 5), 1.5, np.int64(0)).shape == (3, 5)


# ---------------------------------------------------------------- entmaxkv.entmax is the module


def test_entmaxkv_entmax_is_the_module():
    import importlib
    import subprocess
    import sys
    import types

    mod = importlib.import_module("entmaxkv.entmax")
    assert isinstance(mod, types.ModuleType) and entmaxkv.entmax is mod
    import entmaxkv.entmax as as_imported  # IMPORT_FROM reads the package attribute first
    assert as_imported is mod
    assert entmaxkv.alpha_entmax is mod.entmax and "entmax" not in entmaxkv.__all__
    assert "alpha_entmax" in entmaxkv.__all__
    # the same in a fresh interpreter, whatever this process imported before
    code = ("import importlib, entmaxkv, entmaxkv.entmax as m; "
            "assert m is importlib.import_module('entmaxkv.entmax') is entmaxkv.entmax; "
            "from entmaxkv import *; assert callable(alpha_entmax) and 'entmax' not in dir()")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
