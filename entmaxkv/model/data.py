"""Training and evaluation text: a byte-level corpus and passkey prompts.

The corpus is the source of CPython 3.11.7's standard library (the ``.py``
files that ship with the interpreter), minus the test suites, the codec
tables and anything installed into site-packages. It is built once, here,
by ``build_corpus`` and shipped xz-compressed in ``data/`` (the device runs
another Python, whose library would differ), together with a manifest
listing every file, its split and the SHA-256 of each split.

The split is by file: a file goes to the test split when
``crc32(relative_path) % 10 == 0`` (about 10% of the files), to the train
split otherwise. Training samples only the train split; perplexity windows
and passkey haystacks come only from the test split.

Passkeys are 5-digit numbers. Training keys are never multiples of 7,
evaluation keys always are, so no test key is ever seen in training.
"""
from __future__ import annotations

import hashlib
import json
import lzma
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

import numpy as np

def _data_dir() -> Path:
    """data/ of the repository (the corpus ships with it, not with the wheel):
    $ENTMAXKV_DATA, else <repo>/data next to this package, else ./data."""
    env = os.environ.get("ENTMAXKV_DATA")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parents[2] / "data"
    return here if here.is_dir() else Path.cwd() / "data"


DATA_DIR = _data_dir()
CORPUS_NAME = "stdlib311"

# Directories of the standard library left out of the corpus: test suites
# (huge and repetitive), codec tables (mostly escaped byte maps), installed
# third-party packages, build configuration and compiled extensions.
_EXCLUDED_DIRS = {"site-packages", "test", "tests", "encodings", "lib-dynload", "__pycache__"}
_EXCLUDED_PREFIXES = ("config-", "_sysconfigdata")

DOC_SEPARATOR = "\n\n# ==== {path} ====\n"


# --------------------------------------------------------------------- tokenizer
def encode(text) -> np.ndarray:
    """Byte-level tokenizer: str or bytes -> uint8 token ids (vocab 256)."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    return np.frombuffer(bytes(text), dtype=np.uint8).copy()


def decode(tokens: Iterable[int]) -> str:
    """Token ids -> text (invalid UTF-8 shown as U+FFFD)."""
    return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------ corpus
def is_test_file(relpath: str) -> bool:
    """The documented split rule: about 10% of the files are held out."""
    return zlib.crc32(relpath.encode("utf-8")) % 10 == 0


def _corpus_files(stdlib_dir: Path) -> List[str]:
    files = []
    for root, dirs, names in os.walk(stdlib_dir):
        rel_root = Path(root).relative_to(stdlib_dir)
        dirs[:] = sorted(
            d for d in dirs if d not in _EXCLUDED_DIRS and not d.startswith(_EXCLUDED_PREFIXES)
        )
        for name in names:
            if name.endswith(".py") and not name.startswith(_EXCLUDED_PREFIXES):
                files.append((rel_root / name).as_posix())
    return sorted(files)


def build_corpus(stdlib_dir: Optional[str] = None, out_dir: Optional[str] = None) -> dict:
    """Build ``<out_dir>/stdlib311.{train,test}.txt.xz`` and a manifest.

    Deterministic: files in sorted order, each preceded by a one-line header
    naming it; xz preset 9. Returns the manifest.
    """
    import sysconfig

    src = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    out = Path(out_dir or DATA_DIR)
    out.mkdir(parents=True, exist_ok=True)
    parts = {"train": [], "test": []}
    listing = {"train": [], "test": []}
    for rel in _corpus_files(src):
        split = "test" if is_test_file(rel) else "train"
        body = (src / rel).read_bytes()
        parts[split].append(DOC_SEPARATOR.format(path=rel).encode("utf-8") + body)
        listing[split].append(rel)
    manifest = {
        "corpus": CORPUS_NAME,
        "source": f"CPython standard library at {src} (.py files)",
        "excluded_dirs": sorted(_EXCLUDED_DIRS),
        "excluded_prefixes": list(_EXCLUDED_PREFIXES),
        "split_rule": "test iff zlib.crc32(relative_path) % 10 == 0",
        "splits": {},
    }
    for split, chunks in parts.items():
        blob = b"".join(chunks)
        (out / f"{CORPUS_NAME}.{split}.txt.xz").write_bytes(lzma.compress(blob, preset=9))
        manifest["splits"][split] = {
            "files": len(listing[split]),
            "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
            "paths": listing[split],
        }
    (out / f"{CORPUS_NAME}.manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load_split(split: str, data_dir: Optional[str] = None, *, verify: bool = True) -> np.ndarray:
    """uint8 [n] tokens of one split ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
    d = Path(data_dir or DATA_DIR)
    blob = lzma.decompress((d / f"{CORPUS_NAME}.{split}.txt.xz").read_bytes())
    if verify:
        manifest = json.loads((d / f"{CORPUS_NAME}.manifest.json").read_text())
        want = manifest["splits"][split]["sha256"]
        if hashlib.sha256(blob).hexdigest() != want:
            raise RuntimeError(f"corpus split {split!r} does not match its manifest checksum")
    return np.frombuffer(blob, dtype=np.uint8).copy()


# ----------------------------------------------------------------------- passkey
PK_INTRO = "There is a pass key hidden in the text below. Find it and remember it.\n"
PK_NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
PK_QUESTION = "\nWhat is the pass key? The pass key is "
PK_DIGITS = 5


def passkey_min_length() -> int:
    """Tokens of a passkey prompt with an empty haystack: the shortest
    ``length`` that ``passkey_prompt`` accepts (every key has PK_DIGITS digits)."""
    needle = PK_NEEDLE.format(key="0" * PK_DIGITS)
    return len(encode(PK_INTRO)) + len(encode(needle)) + len(encode(PK_QUESTION))


def is_test_key(key: int) -> bool:
    """Evaluation keys are multiples of 7; training keys never are."""
    return key % 7 == 0


def draw_key(rng: np.random.Generator, split: str) -> int:
    want_test = split == "test"
    while True:
        key = int(rng.integers(10 ** (PK_DIGITS - 1), 10**PK_DIGITS))
        if is_test_key(key) == want_test:
            return key


def passkey_prompt(haystack: np.ndarray, key: int, depth: float, length: int) -> np.ndarray:
    """uint8 [length]: intro, haystack with the needle at ``depth``, question.

    The haystack is cut to fit ``length`` exactly; the needle goes at the
    last line break before the requested depth (or exactly there when the
    line is longer than 200 bytes). The answer (the key's digits) is not
    included: it is what the model must produce next.
    """
    intro, needle, question = (encode(s) for s in (PK_INTRO, PK_NEEDLE.format(key=key), PK_QUESTION))
    n_hay = length - len(intro) - len(needle) - len(question)
    if n_hay < 0:
        raise ValueError(f"length: expected at least {passkey_min_length()} tokens for a passkey prompt, got {length}")
    if len(haystack) < n_hay:
        raise ValueError(f"haystack: expected at least {n_hay} bytes, got {len(haystack)}")
    hay = haystack[:n_hay]
    cut = int(round(min(max(depth, 0.0), 1.0) * n_hay))
    nl = np.flatnonzero(hay[max(0, cut - 200):cut] == ord("\n"))
    if len(nl):
        cut = max(0, cut - 200) + int(nl[-1]) + 1
    return np.concatenate([intro, hay[:cut], needle, hay[cut:], question])


@dataclass
class BatchRecipe:
    """How ``sample_batch`` mixes plain text and passkey examples."""

    seq_len: int = 2048
    p_passkey: float = 0.3  # fraction of rows that start with a passkey example
    min_passkey_len: int = 256  # shortest passkey example (prompt + answer)
    answer_weight: float = 5.0  # loss weight of the answer digits (others 1)
    p_copy: float = 0.0  # fraction of rows with a random digit string written twice
    copy_len: Tuple[int, int] = (32, 160)  # length range of that string
    copy_weight: float = 2.0  # loss weight of the second copy (predictable only by copying)


def sample_batch(
    stream: np.ndarray, rng: np.random.Generator, batch: int, recipe: BatchRecipe
) -> Tuple[np.ndarray, np.ndarray]:
    """One training batch from ``stream`` (the train split).

    Returns (tokens uint8 [batch, seq_len + 1], weights float32 [batch,
    seq_len]); the model reads tokens[:, :-1] and predicts tokens[:, 1:],
    the loss of target t weighted by weights[:, t]. A passkey row is a
    passkey prompt of random length and depth, the answer, a line break and
    then plain text to fill the row.
    """
    T = recipe.seq_len
    x = np.empty((batch, T + 1), dtype=np.uint8)
    w = np.ones((batch, T), dtype=np.float32)

    def crop(n: int) -> np.ndarray:
        start = int(rng.integers(0, len(stream) - n))
        return stream[start:start + n]

    for b in range(batch):
        if rng.random() < recipe.p_passkey:
            total = int(rng.integers(min(recipe.min_passkey_len, T + 1), T + 2))
            key = draw_key(rng, "train")
            prompt = passkey_prompt(crop(total), key, float(rng.random()), total - PK_DIGITS)
            example = np.concatenate([prompt, encode(str(key))])
            rest = T + 1 - len(example)
            row = np.concatenate([example, encode("\n")[: max(rest, 0)], crop(max(rest - 1, 0))])
            x[b] = row[: T + 1]
            a = len(prompt)  # token index of the first answer digit
            w[b, a - 1:a - 1 + PK_DIGITS] = recipe.answer_weight
        elif rng.random() < recipe.p_copy / max(1e-9, 1.0 - recipe.p_passkey):
            # Text with the same random digit string at two random places: the
            # second copy can only be predicted by looking back (induction).
            n = int(rng.integers(recipe.copy_len[0], min(recipe.copy_len[1], T // 3) + 1))
            digits = rng.integers(0, 10, size=n)
            s = encode(" ".join("".join(str(d) for d in digits[i:i + 5]) for i in range(0, n, 5)))
            s = np.concatenate([encode("\nserial = '"), s, encode("'\n")])
            row = crop(T + 1).copy()
            a = int(rng.integers(0, T + 1 - 2 * len(s)))
            c = int(rng.integers(a + len(s), T + 2 - len(s)))
            row[a:a + len(s)] = s
            row[c:c + len(s)] = s
            x[b] = row
            w[b, c + 10:c + len(s) - 1] = recipe.copy_weight  # targets inside the 2nd copy
        else:
            x[b] = crop(T + 1)
    return x, w


def test_windows(stream: np.ndarray, n: int, length: int, seed: int) -> np.ndarray:
    """uint8 [n, length]: non-overlapping windows of the test split.

    Windows start at evenly spaced offsets jittered by ``seed``, so they are
    disjoint as long as n * length <= len(stream).
    """
    if n * length > len(stream):
        raise ValueError(f"n: expected n * length <= {len(stream)} (the test split's bytes), got {n} x {length}")
    rng = np.random.default_rng(seed)
    stride = len(stream) // n
    out = np.empty((n, length), dtype=np.uint8)
    for i in range(n):
        start = i * stride + int(rng.integers(0, stride - length + 1))
        out[i] = stream[start:start + length]
    return out
