"""Generation through EntmaxKV: a decode session over per-layer paged caches.

``DecodeSession`` owns one ``PagedKVCache`` per layer (same slots in each),
prefills a batch of equal-length prompts with full attention and then runs
one token per sequence per ``step`` through ``entmaxkv.decode`` with any
policy. ``generate`` is the loop on top (greedy, or sampling with
temperature / top-k / top-p from a seeded generator); ``add_generate_args``
and ``run_generate`` are the ``entmaxkv generate`` command.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch

from .._checks import (as_bool, as_choice, as_dtype, as_float, as_int, describe, device_flag, float_flag,
                       int_flag)
from ..backend import BACKENDS
from ..cache import PagedKVCache
from ..policies import POLICY_NAMES, Certified, Full, Gaussian, TopK, check_policy, make_policy  # noqa: F401
from .lm import TransformerLM
from .step import ModelStep

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# torch.Generator.manual_seed takes seeds in [0, 2**64).
SEED_MAX = 2**64 - 1


def _check_model(model) -> TransformerLM:
    if not isinstance(model, TransformerLM):
        raise ValueError(f"model: expected a TransformerLM, got {describe(model)}")
    return model


def _check_cache_dtype(dtype) -> Optional[torch.dtype]:
    return None if dtype is None else as_dtype(dtype, "cache_dtype", tuple(DTYPES.values()))


def _check_tokens(tokens, name: str, shape: tuple, vocab: int) -> torch.Tensor:
    """An integer tensor of ``shape`` (None: any size there) with ids in [0, vocab).
    The ids are read only for CPU tensors (elsewhere that would synchronise)."""
    text = "[" + ", ".join("T" if n is None else str(n) for n in shape) + "]"
    ok = (isinstance(tokens, torch.Tensor) and tokens.dim() == len(shape) and tokens.dtype in
          (torch.int64, torch.int32, torch.int16, torch.uint8)
          and all(n is None or n == m for n, m in zip(shape, tokens.shape)))
    if not ok:
        raise ValueError(f"{name}: expected an integer tensor of shape {text}, got {describe(tokens)}")
    if tokens.device.type == "cpu" and tokens.numel() and not (
        int(tokens.min()) >= 0 and int(tokens.max()) < vocab
    ):
        raise ValueError(f"{name}: expected token ids in [0, {vocab}), got values in "
                         f"[{int(tokens.min())}, {int(tokens.max())}]")
    return tokens


class DecodeSession:
    """Paged caches for ``batch`` sequences of up to ``max_len`` tokens.

    Args:
        model: the TransformerLM (its parameters' device is used).
        batch: int >= 1, sequences decoded together.
        max_len: int >= 1, longest sequence (prompt + generated tokens).
        page_size: int >= 1, tokens per cache page.
        cache_dtype: storage dtype of the caches, float32/float16/bfloat16
            (default: the model's).
        backend: "auto", "reference" or "triton", passed to ``entmaxkv.decode``.
        copies: int >= 1, decode streams over the same prompt (see ``prefill``).
    """

    def __init__(self, model: TransformerLM, batch: int, max_len: int, *, page_size: int = 16,
                 cache_dtype: Optional[torch.dtype] = None, backend: str = "auto",
                 copies: int = 1) -> None:
        _check_model(model)
        batch = as_int(batch, "batch", lo=1)
        max_len = as_int(max_len, "max_len", lo=1)
        page_size = as_int(page_size, "page_size", lo=1)
        copies = as_int(copies, "copies", lo=1)
        cache_dtype = _check_cache_dtype(cache_dtype)
        backend = as_choice(backend, "backend", BACKENDS)
        cfg = model.cfg
        p = next(model.parameters())
        self.model, self.device, self.backend = model, p.device, backend
        dtype = cache_dtype or p.dtype
        per_seq = -(-max_len // page_size)
        n = batch * copies
        self.caches = [
            PagedKVCache(n * per_seq, page_size, cfg.n_kv_heads, cfg.head_dim, max_seqs=n,
                         max_pages_per_seq=per_seq, dtype=dtype, device=p.device)
            for _ in range(cfg.n_layers)
        ]
        slots = [self.caches[0].allocate() for _ in range(n)]
        for c in self.caches[1:]:
            assert [c.allocate() for _ in range(n)] == slots
        # Copy i (a separate decode stream over the same prompt) owns slots[i].
        self.slots = [slots[i * batch:(i + 1) * batch] for i in range(copies)]
        self.lengths = [0] * copies
        self.batch = batch
        self.max_len = max_len

    @property
    def length(self) -> int:
        return self.lengths[0]

    def prefill(self, tokens: torch.Tensor, *, chunk: Optional[int] = None) -> torch.Tensor:
        """tokens long [batch, T] -> logits of the last position [batch, vocab].
        Every copy receives the same prompt. ``chunk``: query rows per block
        of the full attention (default: about 2^28 scores per block)."""
        _check_tokens(tokens, "tokens", (self.batch, None), self.model.cfg.vocab_size)
        if not 1 <= tokens.shape[1] <= self.max_len:
            raise ValueError(f"tokens: expected 1 to max_len ({self.max_len}) tokens per row, got {tokens.shape[1]}")
        if any(self.lengths):
            raise ValueError("tokens: these caches were prefilled already (expected one prefill, then steps)")
        if chunk is not None:
            chunk = as_int(chunk, "chunk", lo=1)
        else:
            T = tokens.shape[1]
            chunk = max(64, (1 << 28) // max(1, self.batch * self.model.cfg.n_heads * T))
        empty = not any(self.lengths)
        try:
            logits = self.model.prefill(tokens.to(self.device), self.caches, self.slots[0], chunk=chunk,
                                        copies=self.slots[1:])
        except BaseException:
            if empty:  # layers before the failing one were filled: empty them again
                self._empty_slots()
            raise
        self.lengths = [tokens.shape[1]] * len(self.slots)
        return logits

    def _empty_slots(self) -> None:
        """Empty every slot of every layer's cache; the slots stay allocated
        (all of a cache's slots are, so allocate() hands back the one freed)."""
        for cache in self.caches:
            for slot in (s for group in self.slots for s in group):
                if cache.length(slot):
                    cache.free(slot)
                    cache.allocate()

    def step(self, tokens: torch.Tensor, policy, *, return_stats: bool = False, layer_hook=None,
             copy: int = 0):
        """Feed one token per sequence (long [batch]) of copy ``copy``; returns
        logits [batch, vocab] (and per-layer DecodeStats with ``return_stats``).
        ``policy`` is checked by ``entmaxkv.decode``."""
        copy = as_int(copy, "copy", lo=0, hi=len(self.slots) - 1)
        _check_tokens(tokens, "tokens", (self.batch,), self.model.cfg.vocab_size)
        if self.lengths[copy] >= self.max_len:
            raise ValueError(f"tokens: copy {copy} already holds max_len ({self.max_len}) tokens")
        pos = torch.full((self.batch,), self.lengths[copy], dtype=torch.long, device=self.device)
        res = self.model.decode_step(
            tokens.to(self.device), self.caches, self.slots[copy], policy, positions=pos,
            return_stats=return_stats, backend=self.backend, layer_hook=layer_hook,
        )
        self.lengths[copy] += 1
        return res


def sample_next(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token per row from logits [B, V]: greedy when temperature == 0,
    else sampling from softmax(logits / temperature) restricted to the top_k
    tokens (0 = all) and to the smallest set of mass >= top_p.

    logits: float [B, V]; temperature: finite number >= 0; top_k: int >= 0;
    top_p: number in (0, 1]; generator: a CPU torch.Generator or None.
    Raises ValueError naming the argument otherwise.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a float tensor [batch, vocab], got {describe(logits)}")
    temperature = as_float(temperature, "temperature", lo=0.0)
    top_k = as_int(top_k, "top_k", lo=0)
    top_p = as_float(top_p, "top_p", lo=0.0, hi=1.0, lo_open=True)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator or None, got {describe(generator)}")
    if temperature == 0.0:
        return logits.argmax(-1)
    z = logits.float() / temperature
    if top_k and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        zs, idx = z.sort(dim=-1, descending=True)
        cum = zs.softmax(-1).cumsum(-1)
        drop = cum - zs.softmax(-1) >= top_p  # mass before this token already reaches top_p
        zs = zs.masked_fill(drop, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, idx, zs)
    probs = z.softmax(-1)
    # Sample on the CPU so a seed gives the same tokens on every device.
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def _prompt_tensor(prompt, vocab: int) -> torch.Tensor:
    """long [B, T] from the ``prompt`` argument of ``generate``."""
    if isinstance(prompt, (str, bytes)) or prompt is None:
        raise ValueError(f"prompt: expected integer token ids [B, T] or [T] (encode text first), "
                         f"got {describe(prompt)}")
    if not isinstance(prompt, torch.Tensor):
        try:
            prompt = torch.as_tensor(prompt)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"prompt: expected integer token ids [B, T] or [T], got {describe(prompt)}") from None
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt: expected token ids [B, T] or [T] with T >= 1, got {describe(prompt)}")
    if prompt.dtype == torch.bool or prompt.is_floating_point() or prompt.is_complex():
        raise ValueError(f"prompt: expected integer token ids, got dtype {prompt.dtype}")
    return _check_tokens(prompt.to(torch.long), "prompt", (None, None), vocab)


class Stops:
    """Whether every row has produced the stop token, read without stalling
    the device.

    ``add(all_done)`` after each step (a bool scalar tensor on the device)
    returns whether to stop. With ``lag`` = 0 it reads that step's flag at
    once. On CUDA ``generate`` uses ``lag`` = 1: each flag is copied to
    pinned memory behind its step and read (an event wait, no device
    synchronisation) after the next step has been queued, so the host
    prepares a step while the device still runs the one before. A
    generation may then run one step past its end; ``kept()`` says how
    many steps to keep (None: all), reading the flags not read yet.
    """

    def __init__(self, device: torch.device, lag: int) -> None:
        self.lag = as_int(lag, "lag", lo=0)
        self.stopped: Optional[int] = None  # the first step after which every row had stopped
        self._flags: list = []
        self._pinned = ([torch.zeros((), dtype=torch.bool, pin_memory=True) for _ in range(self.lag + 2)]
                        if device.type == "cuda" else None)

    def add(self, all_done: torch.Tensor) -> bool:
        i = len(self._flags)
        if self._pinned is not None:
            host = self._pinned[i % len(self._pinned)]  # not the slot of a flag still unread
            host.copy_(all_done, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._flags.append((host, event))
        else:
            self._flags.append((all_done, None))
        return self._read(i - self.lag)

    def _read(self, i: int) -> bool:
        if self.stopped is None and i >= 0:
            flag, event = self._flags[i]
            if event is not None:
                event.synchronize()
            if bool(flag):
                self.stopped = i
        return self.stopped is not None

    def kept(self) -> Optional[int]:
        for i in range(max(0, len(self._flags) - self.lag), len(self._flags)):
            self._read(i)
        return None if self.stopped is None else self.stopped + 1


@dataclass
class Generation:
    tokens: torch.Tensor  # long [B, new]
    logits: Optional[torch.Tensor] = None  # float [B, new, V] when kept
    stats: List = field(default_factory=list)  # per step: list of per-layer DecodeStats


@torch.no_grad()
def generate(
    model: TransformerLM,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    policy=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    page_size: int = 16,
    cache_dtype: Optional[torch.dtype] = None,
    backend: str = "auto",
    keep_logits: bool = False,
    return_stats: bool = False,
    stop_token: Optional[int] = None,
    cuda_graph: bool = True,
    prefill_chunk: Optional[int] = None,
) -> Generation:
    """Continue each prompt row by ``max_new_tokens`` tokens through EntmaxKV.

    prompt: integer token ids [B, T] or [T] (tensor, NumPy array or list; T >= 1,
    ids in [0, vocab)). The first T - 1 tokens are prefilled with full
    attention; the last prompt token and every generated token then go
    through ``entmaxkv.decode`` with ``policy`` (default Full()), so every
    new token is predicted by the sparse decode path. ``max_new_tokens`` >= 1.
    Sampling (``temperature`` > 0; 0 is greedy) uses a CPU generator seeded
    with ``seed`` (an int >= 0; deterministic); see ``sample_next`` for
    ``top_k`` and ``top_p``. ``stop_token``: an id in [0, vocab), stop once
    every row has produced it; a row that stopped earlier is filled with
    it up to the longest row (on CUDA the check reads each step's flag one
    step later, without a device synchronisation: ``Stops``). Every
    argument is checked before any work (ValueError naming it); the policy
    against the model's alpha and ``page_size``.

    The steps run through ``ModelStep``: on CUDA each step is one replayed
    CUDA graph (``cuda_graph=False``: eager launches); the prompt goes into
    the cache through ``prefill_paged`` in chunks of ``prefill_chunk``
    tokens (default: at once). ``return_stats`` takes the per-layer eager
    path (``DecodeSession``), which reports every layer's DecodeStats.
    """
    _check_model(model)
    vocab = model.cfg.vocab_size
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens", lo=1)
    temperature = as_float(temperature, "temperature", lo=0.0)
    top_k = as_int(top_k, "top_k", lo=0)
    top_p = as_float(top_p, "top_p", lo=0.0, hi=1.0, lo_open=True)
    seed = as_int(seed, "seed", lo=0, hi=SEED_MAX)
    page_size = as_int(page_size, "page_size", lo=1)
    cache_dtype = _check_cache_dtype(cache_dtype)
    backend = as_choice(backend, "backend", BACKENDS)
    keep_logits = as_bool(keep_logits, "keep_logits")
    return_stats = as_bool(return_stats, "return_stats")
    if stop_token is not None:
        stop_token = as_int(stop_token, "stop_token", lo=0, hi=vocab - 1)
    policy = Full() if policy is None else policy
    check_policy(policy, alpha=model.cfg.attn_alpha, page_size=page_size)
    cuda_graph = as_bool(cuda_graph, "cuda_graph")
    if prefill_chunk is not None:
        prefill_chunk = as_int(prefill_chunk, "prefill_chunk", lo=1)
    prompt = _prompt_tensor(prompt, vocab)
    B, T = prompt.shape
    if return_stats:
        sess = DecodeSession(model, B, T + max_new_tokens, page_size=page_size,
                             cache_dtype=cache_dtype, backend=backend)
        if T > 1:
            sess.prefill(prompt[:, :-1])
        device = sess.device

        def step(tokens):
            return sess.step(tokens, policy, return_stats=True)
    else:
        device = next(model.parameters()).device
        per_seq = -(-(T + max_new_tokens) // page_size)
        cache = PagedKVCache(B * per_seq, page_size, model.cfg.n_kv_heads, model.cfg.head_dim, max_seqs=B,
                             max_pages_per_seq=per_seq, dtype=cache_dtype or next(model.parameters()).dtype,
                             device=device, num_layers=model.cfg.n_layers)
        seqs = [cache.allocate() for _ in range(B)]
        if T > 1:
            model.prefill_paged(prompt[:, :-1].to(device), cache, seqs, chunk_tokens=prefill_chunk, backend=backend)
        runner = ModelStep(model, cache, policy, cuda_graph=cuda_graph, backend=backend)

        def step(tokens):
            return runner.step(tokens, seqs)
    gen = torch.Generator().manual_seed(seed)
    cur = prompt[:, -1].to(device)
    out, logits_all, stats = [], [], []
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stops = Stops(device, lag=1 if device.type == "cuda" else 0) if stop_token is not None else None
    for _ in range(max_new_tokens):
        res = step(cur)
        logits, st = (res if return_stats else (res, None))
        if return_stats:
            stats.append(st)
        if keep_logits:
            logits_all.append(logits.float().clone())  # (a graph step reuses its logits buffer)
        cur = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
        if stop_token is not None:
            # a finished row keeps stepping (the batch's captured graph has
            # a fixed shape) but repeats its stop token from then on
            cur = torch.where(done, torch.full_like(cur, stop_token), cur)
            done |= cur == stop_token
        out.append(cur)
        if stops is not None and stops.add(done.all()):
            break
    keep = stops.kept() if stops is not None else None
    if keep is not None:  # (on CUDA the loop may have run one step past the end)
        del out[keep:], logits_all[keep:], stats[keep:]
    return Generation(
        tokens=torch.stack(out, 1).cpu(),
        logits=torch.stack(logits_all, 1).cpu() if keep_logits else None,
        stats=stats,
    )


# ------------------------------------------------------------------------ CLI
def default_device(name: Optional[str]) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


POS = int_flag(lo=1)
NONNEG = int_flag(lo=0)
Q_MAX = float_flag(lo=0.0, hi=1.0, lo_open=True, hi_open=True)
NONNEG_FLOAT = float_flag(lo=0.0)


def add_policy_args(p: argparse.ArgumentParser, *, multi: bool = False) -> None:
    g = p.add_argument_group("selection policy")
    g.add_argument("--policy", choices=list(POLICY_NAMES), default="full",
                   help="page selection policy (default full)")
    g.add_argument("--budget", type=POS, default=1024,
                   help="top-k / certified seed token budget, at least --page-size (default 1024)")
    g.add_argument("--q-max", type=Q_MAX, default=0.995, help="Gaussian page-max quantile in (0, 1) (default 0.995)")
    g.add_argument("--margin", type=NONNEG_FLOAT, default=0.0,
                   help="Gaussian threshold margin >= 0, tau units (default 0)")
    g.add_argument("--pooled", action="store_true", help="pooled Gaussian tau estimate")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default="checkpoints/entmax",
                   help="model folder with model.safetensors + config.json (default checkpoints/entmax)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (default: a short code prompt)")
    src.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=POS, default=200, help="tokens to generate, >= 1 (default 200)")
    p.add_argument("--temperature", type=NONNEG_FLOAT, default=0.0,
                   help="sampling temperature >= 0; 0 = greedy (default 0)")
    p.add_argument("--top-k", type=NONNEG, default=0, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float_flag(lo=0.0, hi=1.0, lo_open=True), default=1.0,
                   help="nucleus sampling mass in (0, 1] (default 1.0)")
    p.add_argument("--seed", type=int_flag(lo=0, hi=SEED_MAX), default=0, help="sampling seed (default 0)")
    p.add_argument("--device", type=device_flag, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--page-size", type=POS, default=16, help="tokens per cache page (default 16)")
    p.add_argument("--cache-dtype", choices=sorted(DTYPES), default="float32",
                   help="cache storage dtype (default float32)")
    p.add_argument("--backend", choices=list(BACKENDS), default="auto",
                   help="decode backend (default auto)")
    p.add_argument("--stats", action="store_true", help="print mean coverage and certified fraction")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="run each decode step's launches eagerly (default on CUDA: one replayed graph per step)")
    p.add_argument("--prefill-chunk", type=POS, default=None,
                   help="prefill the prompt in chunks of this many tokens (default: at once)")
    add_policy_args(p)


def check_budget_flags(args, flags) -> None:
    """ValueError naming the flag when a token budget is below --page-size.
    ``flags``: {flag: list of budgets}."""
    for flag, values in flags.items():
        for b in values:
            if b < args.page_size:
                raise ValueError(f"{flag}: expected at least --page-size ({args.page_size}) tokens, got {b}")


def check_generate_args(args) -> bytes:
    """Check the flags that argparse cannot (paths, combinations); return the
    prompt's bytes. ValueError naming the flag, before any model is loaded."""
    from .checkpoint import check_model_dir

    check_model_dir(args.checkpoint, "--checkpoint")
    if args.policy in ("topk", "certified"):
        check_budget_flags(args, {"--budget": [args.budget]})
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise ValueError(f"--prompt-file: expected a readable file, got {args.prompt_file!r}")
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"--prompt-file: cannot read {args.prompt_file!r} ({exc.strerror})") from None
        if not text:
            raise ValueError(f"--prompt-file: expected at least one byte of prompt, {args.prompt_file!r} is empty")
        return text
    if args.prompt is None:
        return "def fibonacci(n):\n    \"\"\"".encode()
    if not args.prompt:
        raise ValueError("--prompt: expected at least one character of prompt text, got ''")
    return args.prompt.encode("utf-8")


def run_generate(args: argparse.Namespace) -> int:
    from .checkpoint import load_config, load_model
    from .data import decode as detok, encode

    text = check_generate_args(args)
    alpha = load_config(args.checkpoint).attn_alpha
    if alpha == 1.0 and args.policy in ("gaussian", "certified"):
        raise ValueError(f"--policy: {args.policy} needs an entmax model, {args.checkpoint!r} is softmax")
    device = default_device(args.device)
    model = load_model(args.checkpoint, device=device)
    prompt = torch.as_tensor(encode(text), dtype=torch.long)[None]
    policy = make_policy(args.policy, budget=args.budget, q_max=args.q_max, margin=args.margin,
                         pooled=args.pooled)
    g = generate(model, prompt, args.max_new_tokens, policy=policy, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, seed=args.seed, page_size=args.page_size,
                 cache_dtype=DTYPES[args.cache_dtype], backend=args.backend, return_stats=args.stats,
                 cuda_graph=not args.no_cuda_graph, prefill_chunk=args.prefill_chunk)
    sys.stdout.write(detok(prompt[0].tolist()) + detok(g.tokens[0].tolist()) + "\n")
    if args.stats and g.stats:
        cov = torch.stack([torch.stack([s.coverage.float().mean() for s in st]) for st in g.stats])
        cert = torch.stack([torch.stack([s.certified.float().mean() for s in st]) for st in g.stats])
        print(f"[policy {args.policy}] mean coverage {cov.mean():.3f}, certified heads {cert.mean():.3f}",
              file=sys.stderr)
    return 0
