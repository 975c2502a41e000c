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
from typing import List, Optional

import torch

from ..cache import PagedKVCache
from ..policies import Certified, Full, Gaussian, TopK
from .lm import TransformerLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def make_policy(name: str, *, budget: int = 1024, q_max: float = 0.995, margin: float = 0.0,
                pooled: bool = False, seed_budget: Optional[int] = None):
    """A policy from command-line style settings.

    name: "full", "topk" (``budget`` tokens), "gaussian" (``q_max``,
    ``margin``, ``pooled``) or "certified" (seeded by TopK(``seed_budget`` or
    ``budget``)).
    """
    if name == "full":
        return Full()
    if name == "topk":
        return TopK(budget=budget)
    if name == "gaussian":
        return Gaussian(q_max=q_max, margin=margin, pooled=pooled)
    if name == "certified":
        return Certified(seed=TopK(budget=seed_budget or budget))
    raise ValueError(f"policy: expected full, topk, gaussian or certified, got {name!r}")


class DecodeSession:
    """Paged caches for ``batch`` sequences of up to ``max_len`` tokens.

    Args:
        model: the TransformerLM (its parameters' device is used).
        batch: sequences decoded together.
        max_len: longest sequence (prompt + generated tokens).
        page_size: tokens per cache page.
        cache_dtype: storage dtype of the caches (default: the model's).
        backend: passed to ``entmaxkv.decode``.
    """

    def __init__(self, model: TransformerLM, batch: int, max_len: int, *, page_size: int = 16,
                 cache_dtype: Optional[torch.dtype] = None, backend: str = "auto",
                 copies: int = 1) -> None:
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

    @property
    def length(self) -> int:
        return self.lengths[0]

    def prefill(self, tokens: torch.Tensor, *, chunk: Optional[int] = None) -> torch.Tensor:
        """tokens long [batch, T] -> logits of the last position [batch, vocab].
        Every copy receives the same prompt. ``chunk``: query rows per block
        of the full attention (default: about 2^28 scores per block)."""
        if tokens.shape[0] != self.batch:
            raise ValueError(f"tokens: expected {self.batch} rows, got {tokens.shape[0]}")
        if chunk is None:
            T = tokens.shape[1]
            chunk = max(64, (1 << 28) // max(1, self.batch * self.model.cfg.n_heads * T))
        logits = self.model.prefill(tokens.to(self.device), self.caches, self.slots[0], chunk=chunk,
                                    copies=self.slots[1:])
        self.lengths = [tokens.shape[1]] * len(self.slots)
        return logits

    def step(self, tokens: torch.Tensor, policy, *, return_stats: bool = False, layer_hook=None,
             copy: int = 0):
        """Feed one token per sequence (long [batch]) of copy ``copy``; returns
        logits [batch, vocab] (and per-layer DecodeStats with ``return_stats``)."""
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
    tokens (0 = all) and to the smallest set of mass >= top_p."""
    if temperature <= 0.0:
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
) -> Generation:
    """Continue each prompt row by ``max_new_tokens`` tokens through EntmaxKV.

    prompt: long [B, T] (T >= 1, equal lengths). The first T - 1 tokens are
    prefilled with full attention; the last prompt token and every generated
    token then go through ``entmaxkv.decode`` with ``policy`` (default
    Full()), so every new token is predicted by the sparse decode path.
    Sampling uses a CPU generator seeded with ``seed`` (deterministic).
    ``stop_token``: stop once every row has produced it.
    """
    policy = policy or Full()
    prompt = torch.as_tensor(prompt, dtype=torch.long)
    if prompt.dim() == 1:
        prompt = prompt[None]
    B, T = prompt.shape
    if T < 1:
        raise ValueError("prompt: needs at least one token")
    sess = DecodeSession(model, B, T + max_new_tokens, page_size=page_size,
                         cache_dtype=cache_dtype, backend=backend)
    if T > 1:
        sess.prefill(prompt[:, :-1])
    gen = torch.Generator().manual_seed(seed)
    cur = prompt[:, -1].to(sess.device)
    out, logits_all, stats = [], [], []
    done = torch.zeros(B, dtype=torch.bool, device=sess.device)
    for _ in range(max_new_tokens):
        res = sess.step(cur, policy, return_stats=return_stats)
        logits, st = (res if return_stats else (res, None))
        if return_stats:
            stats.append(st)
        if keep_logits:
            logits_all.append(logits.float())
        cur = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
        out.append(cur)
        if stop_token is not None:
            done |= cur == stop_token
            if bool(done.all()):
                break
    return Generation(
        tokens=torch.stack(out, 1).cpu(),
        logits=torch.stack(logits_all, 1).cpu() if keep_logits else None,
        stats=stats,
    )


# ------------------------------------------------------------------------ CLI
def default_device(name: Optional[str]) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def add_policy_args(p: argparse.ArgumentParser, *, multi: bool = False) -> None:
    g = p.add_argument_group("selection policy")
    g.add_argument("--policy", choices=["full", "topk", "gaussian", "certified"], default="full",
                   help="page selection policy (default full)")
    g.add_argument("--budget", type=int, default=1024, help="top-k / certified seed token budget (default 1024)")
    g.add_argument("--q-max", type=float, default=0.995, help="Gaussian page-max quantile (default 0.995)")
    g.add_argument("--margin", type=float, default=0.0, help="Gaussian threshold margin, tau units (default 0)")
    g.add_argument("--pooled", action="store_true", help="pooled Gaussian tau estimate")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default="checkpoints/entmax",
                   help="model folder with model.safetensors + config.json (default checkpoints/entmax)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (default: a short code prompt)")
    src.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per cache page (default 16)")
    p.add_argument("--cache-dtype", choices=sorted(DTYPES), default="float32",
                   help="cache storage dtype (default float32)")
    p.add_argument("--backend", choices=["auto", "reference", "triton"], default="auto",
                   help="decode backend (default auto)")
    p.add_argument("--stats", action="store_true", help="print mean coverage and certified fraction")
    add_policy_args(p)


def run_generate(args: argparse.Namespace) -> int:
    from .checkpoint import load_model
    from .data import decode as detok, encode

    device = default_device(args.device)
    model = load_model(args.checkpoint, device=device)
    if args.prompt_file:
        with open(args.prompt_file, "rb") as f:
            text = f.read()
    else:
        text = args.prompt if args.prompt is not None else "def fibonacci(n):\n    \"\"\""
    prompt = torch.as_tensor(encode(text), dtype=torch.long)[None]
    alpha = model.cfg.attn_alpha
    policy = make_policy(args.policy, budget=args.budget, q_max=args.q_max, margin=args.margin,
                         pooled=args.pooled)
    if alpha == 1.0 and args.policy in ("gaussian", "certified"):
        print(f"error: --policy {args.policy} needs an entmax model", file=sys.stderr)
        return 2
    g = generate(model, prompt, args.max_new_tokens, policy=policy, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, seed=args.seed, page_size=args.page_size,
                 cache_dtype=DTYPES[args.cache_dtype], backend=args.backend, return_stats=args.stats)
    sys.stdout.write(detok(prompt[0].tolist()) + detok(g.tokens[0].tolist()) + "\n")
    if args.stats and g.stats:
        cov = torch.stack([torch.stack([s.coverage.float().mean() for s in st]) for st in g.stats])
        cert = torch.stack([torch.stack([s.certified.float().mean() for s in st]) for st in g.stats])
        print(f"[policy {args.policy}] mean coverage {cov.mean():.3f}, certified heads {cert.mean():.3f}",
              file=sys.stderr)
    return 0
