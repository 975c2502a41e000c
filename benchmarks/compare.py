"""Compare two decode-benchmark results row by row (same config and method).

    python -m benchmarks.compare OLD.json NEW.json [--tolerance 0.03] [--out FILE.json]

Prints each row's median time in both, the ratio new / old and whether it
lies within the tolerance; exits 1 when a row is outside it or missing.
"""
from __future__ import annotations

import argparse
import json
import sys


def _rows(path):
    with open(path) as f:
        data = json.load(f)
    return {(r["config"], r["method"]): r for r in data["rows"]}, data.get("meta", {})


def compare(old_path: str, new_path: str, tolerance: float):
    """Rows of (config, method, old ms, new ms, ratio, within) over the old result's rows
    (new ms None where the new run lacks the row or it failed)."""
    old, _ = _rows(old_path)
    new, _ = _rows(new_path)
    out = []
    for key, row in old.items():
        other = new.get(key)
        if other is None or "ms" not in other or "ms" not in row:
            out.append((*key, row.get("ms"), None, None, False))
            continue
        ratio = other["ms"] / row["ms"]
        out.append((*key, row["ms"], other["ms"], ratio, abs(ratio - 1.0) <= tolerance))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the committed result (bench_decode.json)")
    ap.add_argument("new", help="the new run's result")
    ap.add_argument("--tolerance", type=float, default=0.03, help="allowed |new/old - 1| (default 0.03)")
    ap.add_argument("--out", help="also write the comparison as JSON here")
    args = ap.parse_args(argv)
    rows = compare(args.old, args.new, args.tolerance)
    print(f"{'config':<12} {'method':<18} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
    for cfg, method, a, b, r, ok in rows:
        old = "-" if a is None else f"{a:9.4f}"
        shown = "missing" if b is None else f"{b:9.4f} {r:8.3f}"
        print(f"{cfg:<12} {method:<18} {old:>9} {shown} {'' if ok else '  <-- outside'}")
    bad = [r for r in rows if not r[-1]]
    print(f"{len(rows) - len(bad)} of {len(rows)} rows within ±{args.tolerance:.0%}")
    if args.out:
        keys = ("config", "method", "old_ms", "new_ms", "ratio", "within")
        with open(args.out, "w") as f:
            json.dump({"old": args.old, "new": args.new, "tolerance": args.tolerance,
                       "rows": [dict(zip(keys, r)) for r in rows]}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
