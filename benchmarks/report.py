"""Markdown tables from ``bench_decode.json`` and ``bench_api.json`` (so no number is copied by hand).

    python -m benchmarks.report benchmarks/results/bench_decode.json          # every row
    python -m benchmarks.report benchmarks/results/bench_decode.json --summary  # ms per method
    python -m benchmarks.report benchmarks/results/bench_decode.json --markdown docs/performance.md \
        --api benchmarks/results/bench_api.json --anchor benchmarks/results/anchor_public_api.json
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


# the published code's figures in the anchor file, by bench_api method
_PUBLISHED = {"topk1024": "upstream_topk1024_ms", "gaussian": "upstream_gauss_ms"}


def _anchor_row(anchor, row):
    for a in (anchor or {}).get("rows", []):
        if a["B"] == row["batch"] and a["n"] == row["n"] and row["config"].startswith("paper"):
            return a
    return None


def api_table(rows, anchor=None) -> str:
    """What users call (bench_api.json): per config and policy, ms of the
    graph-replayed step, eager decode(), planned run() (graphs, direct),
    their ratios to the graph, host µs per call, back-to-back ms per call,
    SDPA, and the published code (anchor file) where it was measured."""
    out = ["| config | policy | graph | eager decode | ×graph | run | ×graph | direct run | host µs decode / run / "
           "direct | stream decode / run | README call | SDPA | published | floor |",
           "|---" * 14 + "|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['config']} | {r['method']} | error: {r['error'][:60]} |" + " |" * 11)
            continue
        a = _anchor_row(anchor, r)
        pub = a.get(_PUBLISHED[r["method"]]) if a and r["method"] in _PUBLISHED else None
        out.append(
            f"| {r['config']} | {r['method']} | {r['graph_ms']:.3f} | {r['eager_mean_ms']:.3f} "
            f"| {r['eager_mean_ms'] / r['graph_ms']:.2f} | {r['run_mean_ms']:.3f} | {r['run_mean_ms'] / r['graph_ms']:.2f} "
            f"| {r['direct_mean_ms']:.3f} | {r['eager_host_us']:.0f} / {r['run_host_us']:.0f} / {r['direct_host_us']:.0f} "
            f"| {r['eager_stream_ms']:.3f} / {r['run_stream_ms']:.3f} | {r['default_mean_ms']:.3f} | {r['sdpa_ms']:.3f} "
            f"| {'-' if pub is None else format(pub, '.3f')} | {r['floor_ms']:.3f} |")
    return "\n".join(out)


def api_targets(rows) -> str:
    """The targets of the engine-facing API, each measured row against its bound."""
    by = {(r["config"], r["method"]): r for r in rows if "error" not in r}
    lines = []
    for (c, m), r in by.items():
        if c in ("paper_128k", "paper_b1_2m"):
            lines.append(f"- {c} {m}: eager decode {r['eager_mean_ms'] / r['graph_ms']:.2f}× graph (≤ 1.5), "
                         f"run {r['run_mean_ms'] / r['graph_ms']:.2f}× (≤ 1.2)")
    hosts = [r["run_host_us"] for r in by.values()]
    if hosts:
        lines.append(f"- host µs per run(): {min(hosts):.0f}–{max(hosts):.0f} (≤ 25)")
    for m in ("topk1024", "quest1024"):
        r = by.get(("paper_32k", m))
        if r:
            lines.append(f"- paper_32k {m}: eager decode {r['eager_mean_ms']:.3f} ms against SDPA "
                         f"{r['sdpa_ms']:.3f} ms (faster: {r['eager_mean_ms'] < r['sdpa_ms']})")
    for c in dict.fromkeys(k[0] for k in by):
        cert, full = by.get((c, "certified")), by.get((c, "full_entmax"))
        if cert and full:
            lines.append(f"- {c} certified / full entmax: eager {cert['eager_mean_ms'] / full['eager_mean_ms']:.2f}, "
                         f"run {cert['run_mean_ms'] / full['run_mean_ms']:.2f}, graph-replayed selection step "
                         f"{cert['graph_ms'] / full['graph_ms']:.2f} (≤ 1.05)")
    return "\n".join(lines)


def api_section(path: str, api: dict, anchor=None) -> str:
    meta = api.get("meta", {})
    return "\n".join([
        "## What users call (benchmarks/bench_api.py)",
        "",
        f"- GPU: {meta.get('gpu', '?')}; torch {meta.get('torch', '?')}, Triton {meta.get('triton', '?')}; "
        f"run {meta.get('date', '?')}, `{meta.get('command', '?')}` ({path})",
        "- ms per call, L2 flushed before each, CUDA events around the call, mean of the timed calls (the "
        "certified policy's occasional probe shows in the mean); graph: the selection + attention step "
        "replayed from a CUDA graph; eager decode: `decode(q, cache, ids, policy, check_finite=False)`; run: "
        "`Decoder.run` after `plan` (per-layer graphs); direct run: `cuda_graphs=False`; host µs: the call's "
        "host CPU time; stream: ms per call of calls issued back to back; README call: `decode(q, cache, "
        "ids_list, policy)` (checks q for NaN: one synchronisation); published: the published code's own "
        "benchmark on the same GPU model and data (anchor file, an earlier run), where measured.",
        "",
        api_table(api["rows"], anchor),
        "",
        "Targets:",
        "",
        api_targets(api["rows"]),
        "",
    ])


def performance_page(path: str, data: dict) -> str:
    """docs/performance.md: the run's provenance, then both tables."""
    meta = data.get("meta", {})
    lines = [
        "# Measured performance",
        "",
        f"Generated by `python -m benchmarks.report {path} --markdown docs/performance.md`; do not edit by hand.",
        "",
        f"- GPU: {meta.get('gpu', '?')}; torch {meta.get('torch', '?')}, Triton {meta.get('triton', '?')}, "
        f"Python {meta.get('python', '?')}",
        f"- run: {meta.get('date', '?')}, `{meta.get('command', '?')}`",
        f"- timing: {meta.get('timing', '?')}",
        f"- bytes floor: bytes moved at {meta.get('copy_bandwidth_Bps', 0) / 1e12:.2f} TB/s (the device copy bandwidth)",
        "",
        "## Median ms per method",
        "",
        summary_table(data["rows"]),
        "",
        "## Every row",
        "",
        "ratio to floor = median / bytes floor; vs SDPA = median / torch SDPA's median in the same run; "
        "rel. err = the output against a float32 PyTorch computation over the same pages.",
        "",
        rows_table(data["rows"]),
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--summary", action="store_true", help="median ms per (config, method) only")
    ap.add_argument("--markdown", metavar="FILE", help="write the whole performance page (both tables) to FILE")
    ap.add_argument("--api", metavar="JSON", help="bench_api.json: add the section on what users call")
    ap.add_argument("--anchor", metavar="JSON", help="the published code's figures for the API section")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    api = anchor = None
    if args.api:
        with open(args.api) as f:
            api = json.load(f)
    if args.anchor:
        with open(args.anchor) as f:
            anchor = json.load(f)
    if args.markdown:
        page = performance_page(args.json, data)
        if api is not None:
            page += "\n" + api_section(args.api, api, anchor)
        with open(args.markdown, "w") as f:
            f.write(page)
        return
    if api is not None:
        print(api_table(api["rows"], anchor))
        print(api_targets(api["rows"]))
        return
    print(summary_table(data["rows"]) if args.summary else rows_table(data["rows"]))


if __name__ == "__main__":
    main()
