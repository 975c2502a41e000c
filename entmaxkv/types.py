"""Small named types that cross pipeline stages: the policies (frozen
parameter records), Selection, Pending and DecodeStats.

Every field is a tensor of fixed shape (no Python lists on the hot path), so
a decode step can be captured in a CUDA graph and sharded by pages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from ._checks import as_bool, as_float, as_int, describe


@dataclass
class Selection:
    """Pages chosen for attention, per batch row and per selection head.

    Attributes:
        pages:   int32 [batch, sel_heads, width]: *logical* page indices (the
                 position of a page in its sequence's block table, 0-based).
                 Entries at positions ``>= counts`` are padding and must be
                 ignored; the valid entries are distinct, in no particular
                 order (the reference sorts them, the kernels need not).
        counts:  int32 [batch, sel_heads]: number of valid entries per row.
        tau_hat: float32 [batch, q_heads] or None: the policy's estimate of the
                 entmax threshold (a warm start for the exact solve).
        tau_lower: float32 [batch, q_heads] or None: a proven lower bound on
                 the entmax threshold over the selected tokens (the certified
                 policy's tau over its seed, which the selection contains).
                 Scores below it have zero weight, so the Triton attention
                 never keeps them as candidates; a value above the true
                 threshold would drop support tokens.
        pending: Pending or None: set by a selection whose last kernel may
                 still be running when the next launch starts (the Triton
                 top-k through _rowsel_kernel). Leave it None when building
                 a Selection by hand.

    ``sel_heads`` is ``kv_heads`` (default: one selection per KV head, the
    union over its query-head group, so each page is read once per group) or
    ``q_heads`` (per-query-head selection).
    """

    pages: torch.Tensor
    counts: torch.Tensor
    tau_hat: Optional[torch.Tensor] = None
    tau_lower: Optional[torch.Tensor] = None
    pending: Optional["Pending"] = field(default=None, repr=False, compare=False)

    @property
    def sel_heads(self) -> int:
        return self.pages.shape[1]

    @property
    def width(self) -> int:
        return self.pages.shape[2]


@dataclass
class Pending:
    """A selection kernel that may still be running (programmatic dependent
    launch) when the attention after it starts.

    Attributes:
        counters: int32 [2, batch, sel_heads], zeroed before the selection.
                  counters[0] reaches 1 once a row's pages and count are
                  written, so the attention can start on that row without
                  waiting for the whole selection; counters[1] is for the
                  attention's own launches (its split programs count in).
        launch:   kernels._common.launch_count() after the selection's last
                  launch: only an attention launched next (no other step
                  launch between) may poll the counters.
        hold:     the selection's scratch tensors, kept alive with the
                  Selection: a launch that starts before the selection has
                  ended must not be given their memory.
    """

    counters: torch.Tensor
    launch: int
    hold: tuple = ()


@dataclass
class DecodeStats:
    """Per-query-head statistics of one decode step (all [batch, q_heads]).

    Attributes:
        pages_read:  int32, pages whose K/V the head attended over.
        tokens_read: int32, valid tokens in those pages.
        coverage:    float32, tokens_read / sequence length.
        tau:         float32, the exact threshold solved over the kept tokens
                     (for softmax, alpha = 1: the log-sum-exp of the kept scores).
        certified:   bool, True when the result provably equals full-cache
                     attention: every unselected page has (alpha-1) * bound
                     <= tau (docs/spec.md §5); always False for softmax unless
                     every page was read.
    """

    pages_read: torch.Tensor
    tokens_read: torch.Tensor
    coverage: torch.Tensor
    tau: torch.Tensor
    certified: torch.Tensor


# ----------------------------------------------------------------- policies
# Each policy checks its fields when it is built (ValueError naming the
# field) and stores them as plain Python values, so a NumPy number or bool
# gives a policy equal to (and hashing like) the one built from Python values.
# What depends on the cache or alpha is checked by policies.check_policy.


def check_policy_fields(policy, prefix: str) -> dict:
    """The checked field values of ``policy`` (error messages name them as
    ``prefix.field``): ints >= 0 for sinks/window, a bool per_query_head,
    TopK budget >= 1, Gaussian q_max in (0, 1), finite margin >= 0, bool
    pooled, and a TopK or Gaussian seed for Certified."""
    vals = {"per_query_head": as_bool(policy.per_query_head, f"{prefix}.per_query_head")}
    if isinstance(policy, Full):
        return vals
    for name in ("sinks", "window"):
        vals[name] = as_int(getattr(policy, name), f"{prefix}.{name}", lo=0)
    if isinstance(policy, TopK):
        vals["budget"] = as_int(policy.budget, f"{prefix}.budget", lo=1)
    elif isinstance(policy, Gaussian):
        vals["q_max"] = as_float(policy.q_max, f"{prefix}.q_max", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
        vals["margin"] = as_float(policy.margin, f"{prefix}.margin", lo=0.0)
        vals["pooled"] = as_bool(policy.pooled, f"{prefix}.pooled")
    elif isinstance(policy, Certified):
        if not isinstance(policy.seed, (TopK, Gaussian)):
            raise ValueError(f"{prefix}.seed: expected a TopK or Gaussian policy, got {describe(policy.seed)}")
        if policy.alibi_seed is not None and not isinstance(policy.alibi_seed, (TopK, Gaussian)):
            raise ValueError(f"{prefix}.alibi_seed: expected None or a TopK or Gaussian policy, got "
                             f"{describe(policy.alibi_seed)}")
        vals["dense_above"] = as_float(policy.dense_above, f"{prefix}.dense_above", lo=0.0, hi=1.0, lo_open=True)
        vals["probe_every"] = as_int(policy.probe_every, f"{prefix}.probe_every", lo=1)
    return vals


def _store_checked(policy) -> None:
    for name, value in check_policy_fields(policy, type(policy).__name__).items():
        object.__setattr__(policy, name, value)


@dataclass(frozen=True)
class Full:
    """Read every page: dense attention over the whole cache.

    Attributes:
        per_query_head: bool, one selection per query head (default: per KV head).
    """

    per_query_head: bool = False
    name = "full"

    def __post_init__(self) -> None:
        _store_checked(self)


@dataclass(frozen=True)
class TopK:
    """Quest-style top-k: the budget//page_size pages of highest Quest bound.

    The forced pages (last page, sinks, window) come first; the rest of the
    page budget goes to the highest-bound pages. With alpha = 1 this is Quest.

    Attributes:
        budget: int token budget, >= 1 here and >= the cache's page size at
            decode; pages kept = max(budget // P, forced).
        sinks, window: ints >= 0: first / last pages always kept.
        per_query_head: bool, one selection per query head.
    """

    budget: int = 1024
    sinks: int = 0
    window: int = 0
    per_query_head: bool = False
    name = "topk"

    def __post_init__(self) -> None:
        _store_checked(self)


@dataclass(frozen=True)
class Gaussian:
    """Gaussian-aware selection with an estimated entmax threshold tau_hat.

    Attributes:
        q_max: number in (0, 1): quantile of a page's largest score used to
            screen it (z = Phi^{-1}(q_max^(1/n)) for a page of n tokens).
        margin: finite number >= 0, in tau units: pages are kept when
            (alpha-1) * (mu + z sigma) > tau_hat - margin.
        pooled: bool, one pooled Gaussian for the whole row instead of the
            page mixture when solving for tau_hat (cheaper, coarser).
        sinks, window, per_query_head: as for TopK.

    Needs entmax: decode (check_policy) raises a ValueError naming ``alpha``
    when alpha runs as softmax (alpha = 1, or alpha - 1 < 2^-33,
    entmaxkv.limits.effective_alpha).
    """

    q_max: float = 0.995
    margin: float = 0.0
    pooled: bool = False
    sinks: int = 0
    window: int = 0
    per_query_head: bool = False
    name = "gaussian"

    def __post_init__(self) -> None:
        _store_checked(self)


@dataclass(frozen=True)
class Certified:
    """Selection that provably contains the entmax support (delta = 0).

    Start from ``seed``'s selection A, solve tau_A exactly over it, then add
    every page with (alpha-1) * u_p > tau_A. Because tau over a subset never
    exceeds tau over a superset (docs/spec.md §1), every page still left out
    satisfies (alpha-1) * u_p <= tau_A <= tau_{A'} <= tau_full: one
    augmentation already certifies the result, so the loop of docs/spec.md §5
    always stops after this round (its second pass adds nothing).

    Attributes:
        seed: a TopK or Gaussian policy (default TopK(1024)).
        alibi_seed: None, or a TopK or Gaussian policy that seeds instead of
            ``seed`` the selection heads whose query heads all have a
            positive ALiBi slope: their support sits near the query, so a
            smaller seed already holds it (e.g. TopK(256) beside TopK(1024)
            for the heads without a slope). Ignored without slopes.
        sinks, window, per_query_head: as for TopK.
        dense_above: number in (0, 1]: when a step's selection kept more
            than this fraction of the pages, the next steps of that layer run
            the dense pass instead (every page: full-cache attention, so still
            exact and certified), cheaper than selecting almost everything
            (``planner.Decoder``; 1 never switches).
        probe_every: int >= 1: while dense, every probe_every-th step runs
            the selection again to see whether it still keeps that much
            (1 never switches either). ``ModelStep`` replaying CUDA graphs
            decides by the two forms' measured times instead
            (``entmaxkv.model.switch``; there the wait between probes
            doubles while they confirm the choice, up to 8 x probe_every),
            with the same two switches off.

    Needs entmax, whatever the seed: decode (check_policy) raises a
    ValueError naming ``alpha`` when alpha runs as softmax (alpha = 1, or
    alpha - 1 < 2^-33, entmaxkv.limits.effective_alpha).
    """

    seed: Union[TopK, Gaussian] = field(default_factory=lambda: TopK(1024))
    alibi_seed: Optional[Union[TopK, Gaussian]] = None
    sinks: int = 0
    window: int = 0
    per_query_head: bool = False
    dense_above: float = 0.75
    probe_every: int = 16
    name = "certified"

    def __post_init__(self) -> None:
        _store_checked(self)


Policy = Union[Full, TopK, Gaussian, Certified]
POLICIES = {"full": Full, "topk": TopK, "gaussian": Gaussian, "certified": Certified}
