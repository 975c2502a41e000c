"""An lm-evaluation-harness model: transformers generation through EntmaxKV.

Importing this module registers the model "entmaxkv" (lm-eval's HF model
with every forward and ``generate`` going through an ``EntmaxKVCache``).
Model args: those of lm-eval's ``hf`` model (``pretrained=...``) plus
``policy`` (full / topk / gaussian / certified), ``budget``, ``alpha``,
``page_size`` and ``backend``. ``TASKS`` is the folder of the tasks this
project ships (``entmaxkv_passkey``: passkey retrieval over the twins' test
split, built locally); tasks that download their data need a network.

    python -m entmaxkv.hf.lm_eval --model entmaxkv \\
        --model_args pretrained=out/hf/entmax,policy=topk,budget=256,page_size=16 \\
        --tasks entmaxkv_passkey --batch_size 1
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from . import register
from .cache import EntmaxKVCache

__all__ = ["EntmaxKVLM", "TASKS", "main"]

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"


@register_model("entmaxkv")
class EntmaxKVLM(HFLM):
    """lm-eval's HF causal LM, its attention and cache EntmaxKV's."""

    def __init__(self, pretrained, policy: str = "topk", budget: int = 1024, alpha=None, page_size: int = 16,
                 backend: str = "auto", **kwargs):
        from ..model.generate import make_policy

        register()
        super().__init__(pretrained=pretrained, **kwargs)
        self.model.set_attn_implementation("entmaxkv")
        self.entmaxkv = dict(policy=make_policy(policy, budget=int(budget)),
                             alpha=None if alpha in (None, "None") else float(alpha), page_size=int(page_size),
                             backend=backend)

    def _cache(self, length: int) -> EntmaxKVCache:
        return EntmaxKVCache(self.model, max_len=int(length), **self.entmaxkv)

    def _model_call(self, inps, attn_mask=None, labels=None):
        with torch.no_grad():
            return self.model(inps, past_key_values=self._cache(inps.shape[1])).logits

    def _model_generate(self, context, max_length: int, stop, **generation_kwargs):
        generation_kwargs["past_key_values"] = self._cache(max_length)
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def main(argv=None) -> None:
    """lm-eval's command line with this model registered and this project's
    tasks on the include path."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in args:
        args += ["--include_path", str(TASKS)]
    sys.argv = ["lm_eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
