"""The certified step's candidate lists on the entmax twin (a diagnostic, GPU).

The twin prefills ``length`` tokens of the test split and decodes two
tokens with Certified(TopK(1024)) (eager steps). At every layer the same
query is run again through the certified selection and the entmax split
pass alone (``kernels.attention.candidates``, which does not start at the
selection's ``tau_lower``), and one JSON row per layer and step records,
per query head:

- ``cand``: the candidates the split pass stages (scores at or above its
  running bound);
- ``max_list``: the longest of the head's per-split lists;
- ``after_prune``: the candidates above the best bound over the splits
  (what the finish keeps when it prunes);
- ``support``: the tokens with nonzero weight;

with the kept pages per selection head (mean), the selection width and the
split count. ``--dump`` also saves, per layer and step, every head's listed
scores (float32, sorted descending), its best bound over the splits, the
selection's tau_lower and tau, for the certified selection and for every
page (Full), to ``cert_lists.pt``: the solver's inputs, for studying the
solve offline.

    python -m benchmarks.cert_lists --length 131072 --out DIR [--dump]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from entmaxkv.kernels.attention.launch import candidates, selection_tau
from entmaxkv.kernels.attention.plan import _plan
from entmaxkv.kernels.config import DEFAULT
from entmaxkv.kernels.select import select
from entmaxkv.model.step import ModelStep
from entmaxkv.policies import Full

from .bench_generate import METHODS, build_model, paged_cache, prompt_tokens


def _dumped(scores, lower, tau, tau_lower=None) -> dict:
    """The solver's inputs of one layer: per head its listed scores (sorted
    descending, float32 on the CPU), the best bound, tau and tau_lower."""
    rows = [s[torch.isfinite(s)].sort(descending=True).values.float().cpu() for s in scores]
    out = dict(scores=rows, lower=lower.float().cpu(), tau=tau.float().cpu())
    if tau_lower is not None:
        out["tau_lower"] = tau_lower.reshape(-1).float().cpu()
    return out


def layer_lists(dec, q, kv, policy, dump=None) -> dict:
    """One layer's list statistics for query q [1, HQ, D] (see the module
    docstring); with ``dump`` (a list) appends the solver's inputs of the
    certified selection and of Full (_dumped) to it."""
    bt, sl, ids = dec._plan
    layer = dec._layer(kv, bt, sl)
    args = dict(alpha=dec.alpha, scale=dec.scale, slopes=dec.slopes)
    sel = select(policy, q, layer, ids, **args)
    scores, _, lower = candidates(q, layer, ids, sel, **args)
    tau = selection_tau(q, layer, ids, sel, **args).view(-1)
    S, W = sel.pages.shape[1], sel.pages.shape[2]
    # (the plan _run makes for this selection: candidates() returns the lists flattened)
    nsplit = _plan(DEFAULT.attention, q.shape[0], S, q.shape[1] // S, q.shape[2], W, layer.page_size, q.device,
                   False, layer.k_pages.element_size(), False)["NSPLIT"]
    listed = torch.isfinite(scores)
    if dump is not None:
        full_scores, _, full_lower = candidates(q, layer, ids, None, **args)
        full_tau = selection_tau(q, layer, ids, select(Full(), q, layer, ids, **args), **args).view(-1)
        dump.append(dict(certified=_dumped(scores, lower, tau, sel.tau_lower),
                         full=_dumped(full_scores, full_lower, full_tau)))
    return dict(kept_pages=sel.counts.float().mean().item(), W=W, nsplit=nsplit,
                cand=listed.sum(1).tolist(),
                max_list=listed.view(scores.shape[0], nsplit, -1).sum(-1).max(1).values.tolist(),
                after_prune=(scores > lower[:, None]).sum(1).tolist(),
                support=(((dec.alpha - 1.0) * scores) > tau[:, None]).sum(1).tolist())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=131072, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=2, help="decode steps")
    ap.add_argument("--checkpoint", default="checkpoints/entmax")
    ap.add_argument("--out", default=None, help="folder for cert_lists.json (and cert_lists.pt)")
    ap.add_argument("--dump", action="store_true", help="also save the solver's inputs to cert_lists.pt")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model("twin", dev, args.checkpoint)
    cache = paged_cache(model, 1, args.length + args.steps, 16)
    seqs = [cache.allocate()]
    rows = []
    dump = [] if args.dump else None
    with torch.no_grad():
        tok = model.prefill_paged(prompt_tokens("twin", 1, args.length, 256).to(dev), cache, seqs,
                                  chunk_tokens=16384).argmax(-1)
        _, policy = METHODS["certified"]
        run = ModelStep(model, cache, policy, cuda_graph=False)
        dec = run.decoder
        step_run = dec.run

        def traced(q, kv, out=None, **kw):  # the step's own call, then the lists of the same query
            res = step_run(q, kv, out, **kw)
            rows.append(dict(layer=len(rows) % model.cfg.n_layers, **layer_lists(dec, q, kv, policy, dump)))
            print(json.dumps(rows[-1]), flush=True)
            return res

        dec.run = traced
        for _ in range(args.steps):
            tok = run.step(tok, seqs).argmax(-1)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cert_lists.json"), "w") as f:
            json.dump(rows, f)
        if dump is not None:
            torch.save(dump, os.path.join(args.out, "cert_lists.pt"))
    return rows


if __name__ == "__main__":
    main()
