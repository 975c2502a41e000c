"""Probe (a GPU script): does reading a projection's weights into L2 on a side
stream, while a latency-bound chain runs, make the projection's GEMV faster
afterwards? The chain stands in for a batch-1 top-k layer's selection and
attention, which leave most of the GPU's bandwidth idle.

    python -m benchmarks.l2_probe OUT.json

Per matrix (the 8B shape's o_proj 4096 x 4096 and qkv 6144 x 4096, bf16),
median microseconds of 30, L2 flushed before each: the GEMV cold, after an
evict_last read of its weights, after that and an evict_first read of a
layer's page boxes; then ``seqN`` (page boxes, chain, GEMV in order) against
``parN`` (the same with the weights read on a side stream meanwhile).
"""
import json
import sys

import torch
import triton
import triton.language as tl

@triton.jit
def _touch(x_ptr, out_ptr, N, BLOCK: tl.constexpr, STEPS: tl.constexpr, LAST: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(STEPS):
        o = (i * STEPS + s) * BLOCK + tl.arange(0, BLOCK)
        if LAST:
            v = tl.load(x_ptr + o, mask=o < N, other=0.0, eviction_policy="evict_last")
        else:
            v = tl.load(x_ptr + o, mask=o < N, other=0.0, eviction_policy="evict_first")
        acc = tl.maximum(acc, v.to(tl.float32))
    m = tl.max(acc, axis=0)
    tl.store(out_ptr + i, m, mask=m == 12345.0)  # (never true: keeps the loads)

def touch(x, out, last):
    """Read all of x (evict_last: to stay in L2; else evict_first)."""
    block, steps = 4096, 4
    _touch[(triton.cdiv(x.numel(), block * steps),)](x, out, x.numel(), BLOCK=block, STEPS=steps, LAST=last,
                                                     num_warps=8)

@triton.jit
def _chain(buf_ptr, n_iter, SPIN: tl.constexpr):
    """n_iter dependent loads per program: latency-bound work on a few SMs."""
    i = tl.program_id(0)
    v = tl.load(buf_ptr + i)
    for _ in range(n_iter):
        v = tl.load(buf_ptr + (v & 1023) + i * 0)
    tl.store(buf_ptr + 2048 + i, v)

def timed(pre, body, flush, reps=30):
    """Median microseconds of body() (CUDA events), after flushing L2 and running pre()."""
    ts = []
    for _ in range(reps):
        flush.zero_()
        pre()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        body()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def probe(n_out, n_in, flush, meta, out, buf, s2):
    """The timings of one n_out x n_in bf16 matrix (the module docstring's keys)."""
    dev = "cuda"
    W = torch.randn(n_out, n_in, dtype=torch.bfloat16, device=dev)
    x = torch.randn(1, n_in, dtype=torch.bfloat16, device=dev)
    y = torch.empty(1, n_out, dtype=torch.bfloat16, device=dev)

    def gemv():
        torch.mm(x, W.t(), out=y)

    for _ in range(3):  # compile and warm every kernel
        gemv()
        touch(W, out, True)
        touch(meta, out, False)
        _chain[(8,)](buf, 2000, SPIN=0)
    torch.cuda.synchronize()
    r = {"gemv_cold_us": timed(lambda: None, gemv, flush),
         "gemv_after_touch_us": timed(lambda: touch(W, out, True), gemv, flush),
         "gemv_after_touch_meta_us": timed(lambda: (touch(W, out, True), touch(meta, out, False)), gemv, flush),
         "touch_alone_us": timed(lambda: None, lambda: touch(W, out, True), flush),
         "meta_read_us": timed(lambda: None, lambda: touch(meta, out, False), flush)}
    for iters in (200, 1000, 3000):
        def chain(iters=iters):
            _chain[(8,)](buf, iters, SPIN=0)

        def seq(chain=chain):
            touch(meta, out, False)
            chain()
            gemv()

        def par(chain=chain):
            cur = torch.cuda.current_stream()
            s2.wait_stream(cur)
            with torch.cuda.stream(s2):
                touch(W, out, True)
            touch(meta, out, False)
            chain()
            cur.wait_stream(s2)
            gemv()

        r[f"chain{iters}_us"] = timed(lambda: None, chain, flush)
        r[f"seq{iters}_us"] = timed(lambda: None, seq, flush)
        r[f"par{iters}_us"] = timed(lambda: None, par, flush)
    return r


def main(path):
    dev = "cuda"
    res = {"gpu": torch.cuda.get_device_name()}
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    meta = torch.randn(34 * 2**20 // 2, dtype=torch.bfloat16, device=dev)  # a layer's page boxes at 128k
    out = torch.empty(1 << 16, device=dev)
    buf = torch.zeros(4096, dtype=torch.int32, device=dev)
    s2 = torch.cuda.Stream()
    for name, shape in {"o_proj": (4096, 4096), "qkv": (6144, 4096)}.items():
        res[name] = probe(*shape, flush, meta, out, buf, s2)
        print(name, json.dumps(res[name]), flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
