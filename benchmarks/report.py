"""Markdown tables from ``bench_decode.json`` (so no number is copied by hand).

    python -m benchmarks.report benchmarks/results/bench_decode.json          # every row
    python -m benchmarks.report benchmarks/results/bench_decode.json --summary  # ms per method
"""
from __future__ import annotations

import argparse
import json

METHODS = ["full_softmax", "full_entmax", "sdpa", "quest_topk1024", "entmax_topk1024",
           "entmax_topk4096", "gaussian", "certified"]


def rows_table(rows) -> str:
    sdpa = {r["config"]: r["ms"] for r in rows if r["method"] == "sdpa" and "ms" in r}
    out = ["| config | method | batch | n | median ms | bytes (GB) | floor ms | ratio to floor | vs SDPA "
           "| coverage | rel. err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" not in r:
            out.append(f"| {r['config']} | {r['method']} | {r['batch']} | {r['n']} | error: {r.get('error', '')[:60]} "
                       "| | | | | | |")
            continue
        err = r.get("rel_err")
        out.append(
            f"| {r['config']} | {r['method']} | {r['batch']} | {r['n']} | {r['ms']:.3f} | {r['bytes'] / 1e9:.3f} "
            f"| {r['floor_ms']:.3f} | {r['ratio']:.2f} | {r['ms'] / sdpa[r['config']]:.2f} | {r['coverage']:.3f} "
            f"| {'-' if err is None else format(err, '.1e')} |")
    return "\n".join(out)


def summary_table(rows) -> str:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    by = {(r["config"], r["method"]): r for r in rows if "ms" in r}
    out = ["| config | " + " | ".join(METHODS) + " |", "|---" * (len(METHODS) + 1) + "|"]
    for c in configs:
        cells = []
        for m in METHODS:
            r = by.get((c, m))
            if r is None:
                cells.append("-")
            elif m == "gaussian":
                cells.append(f"{r['ms']:.3f} ({r['coverage']:.3f})")
            else:
                cells.append(f"{r['ms']:.3f}")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--summary", action="store_true", help="median ms per (config, method) only")
    args = ap.parse_args(argv)
    rows = json.load(open(args.json))["rows"]
    print(summary_table(rows) if args.summary else rows_table(rows))


if __name__ == "__main__":
    main()
