"""Command line: `entmaxkv demo | generate | quality | passkey | perplexity | bench latency`.

`entmaxkv demo` is the main job (see entmaxkv/demo.py). The model and
evaluation commands live in entmaxkv/model and entmaxkv/eval; each module
contributes an ``add_<name>_args(parser)`` and a ``run_<name>(args)``.

Bad input never ends in a traceback: a flag of the wrong type or range is
an argparse error (the flags' types come from entmaxkv/_checks.py), flags
that do not fit together are a ValueError raised by the command before any
work starts, and any ValueError from the library is reported the same way:
one line ``<prog>: error: <message>`` on stderr and exit status 2.
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
    "bench": ("entmaxkv.bench", "benchmarks of what users run: `entmaxkv bench latency` (vLLM's conventions)"),
}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (status 2),
    not the usage text followed by the error; ``--help`` shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def one_line(message) -> str:
    """``message`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(message).split())


def run(parser: argparse.ArgumentParser, argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` and run the command the parser set as ``func``; return
    the exit status instead of raising SystemExit (0 after --help/--version,
    2 for bad input, which is reported as one line on stderr)."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    prog = getattr(args, "cli_prog", parser.prog)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
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
    d.set_defaults(func=main_demo, cli_prog=d.prog)
    for name, (module, help_text) in EXTRA_COMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=help_text, description=help_text)
        getattr(mod, f"add_{name}_args")(sp)
        sp.set_defaults(func=getattr(mod, f"run_{name}"), cli_prog=sp.prog)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``entmaxkv`` with ``argv`` (default sys.argv[1:]); returns the exit status."""
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
