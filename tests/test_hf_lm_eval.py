"""The lm-eval model "entmaxkv" runs the shipped local task end to end with
the entmax twin (converted to a transformers folder)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

import entmaxkv.hf as H  # noqa: E402
from entmaxkv.hf.lm_eval import TASKS, EntmaxKVLM  # noqa: E402

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


def test_passkey_task_end_to_end(tmp_path):
    from lm_eval.tasks import TaskManager

    folder = H.convert(CHECKPOINTS / "entmax", tmp_path / "entmax")
    res = lm_eval.simple_evaluate(
        model="entmaxkv", model_args=f"pretrained={folder},policy=topk,budget=128,page_size=16,device=cpu",
        tasks=["entmaxkv_passkey"], task_manager=TaskManager(include_path=str(TASKS)), batch_size=1, limit=3)
    score = res["results"]["entmaxkv_passkey"]["exact_match,digits"]
    assert 0.66 <= float(score) <= 1.0  # the twin retrieves passkeys at this length
    assert res["config"]["model"] == "entmaxkv" and EntmaxKVLM.__name__ == "EntmaxKVLM"
