"""Convert the twin checkpoints to transformers folders (a script).

Each of checkpoints/entmax and checkpoints/softmax becomes a
``save_pretrained`` folder with its byte-level tokenizer, loadable with
``AutoModelForCausalLM`` / ``AutoTokenizer`` after ``entmaxkv.hf.register()``
(a few seconds; the folders are not committed):

    python scripts/convert_twins_hf.py --out out/hf      # -> out/hf/entmax, out/hf/softmax
"""
from __future__ import annotations

import argparse
from pathlib import Path

from entmaxkv.hf import convert, register

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", default=str(ROOT / "checkpoints"), help="folder holding entmax/ and softmax/")
    ap.add_argument("--out", default=str(ROOT / "out" / "hf"), help="output folder (default out/hf)")
    args = ap.parse_args(argv)
    register()
    for name in ("entmax", "softmax"):
        src = Path(args.checkpoints) / name
        if not (src / "config.json").is_file():
            ap.error(f"--checkpoints: {src} holds no checkpoint (config.json)")
        print(convert(src, Path(args.out) / name))


if __name__ == "__main__":
    main()
