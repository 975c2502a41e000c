"""Command line: `entmaxkv demo | generate | quality | passkey | perplexity`.

`entmaxkv demo` is the main job (see entmaxkv/demo.py). The model and
evaluation commands live in entmaxkv/model and entmaxkv/eval; each module
contributes an ``add_<name>_args(parser)`` and a ``run_<name>(args)``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from . import __version__
from .demo import add_demo_args, main_demo

# command -> (module, help); imported lazily so `entmaxkv demo` stays light.
EXTRA_COMMANDS = {
    "generate": ("entmaxkv.model.generate", "generate text with a trained entmax/softmax model through EntmaxKV"),
    "quality": ("entmaxkv.eval.quality", "approximation quality (delta, rho, R, coverage) per policy: synthetic and captured Q/K/V"),
    "passkey": ("entmaxkv.eval.passkey", "passkey retrieval accuracy over context lengths and token budgets"),
    "perplexity": ("entmaxkv.eval.perplexity", "held-out perplexity under full and sparse decoding"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="entmaxkv",
        description="Fast long-context decoding with alpha-entmax attention over a paged KV cache.",
    )
    p.add_argument("--version", action="version", version=f"entmaxkv {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    d = sub.add_parser(
        "demo",
        help="decode a long synthetic cache with every policy and print quality and time",
        description="Build a synthetic paged cache (default 16k tokens, batch 2, 8 query / 4 KV heads, "
        "head dim 64), decode one step with every policy that applies and print coverage, dropped "
        "mass delta, support recall rho, relative error R and time per policy.",
    )
    add_demo_args(d)
    d.set_defaults(func=main_demo)
    for name, (module, help_text) in EXTRA_COMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=help_text, description=help_text)
        getattr(mod, f"add_{name}_args")(sp)
        sp.set_defaults(func=getattr(mod, f"run_{name}"))
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
