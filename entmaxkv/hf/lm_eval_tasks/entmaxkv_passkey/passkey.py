"""The entmaxkv_passkey task's data: passkey prompts built from the test
split of the twins' corpus with test keys (entmaxkv.eval.passkey's
prompts), nothing downloaded. ``length``, ``examples`` and ``seed`` come
from the task's metadata."""
from __future__ import annotations

import datasets
import numpy as np

from entmaxkv.eval.passkey import build_prompts
from entmaxkv.model.data import decode, load_split


def dataset(length: int = 600, examples: int = 10, seed: int = 0, **kwargs):
    stream = load_split("test")
    prompts, keys = build_prompts(stream, int(length), int(examples), np.random.default_rng(int(seed)))
    rows = {"prompt": [decode(p.tolist()) for p in prompts], "key": [str(k) for k in keys]}
    return {"test": datasets.Dataset.from_dict(rows)}
