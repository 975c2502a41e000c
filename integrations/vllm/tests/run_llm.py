"""Serve prompts with ``vllm.LLM`` in a process of its own; print the result as JSON.

Usage: ``python run_llm.py '<json>'`` with keys ``model``, ``prompts``
(lists of token ids), ``max_tokens``, ``block_size``, optional
``entmaxkv`` (the backend's settings), ``max_num_batched_tokens``,
``max_model_len``, ``extra_prompts`` (served after the first batch, one
generate call each, e.g. a prompt that must be refused). Prints one line:
``{"tokens": [[...], ...], "extra": [...]}``; an extra prompt that vLLM
refuses gives ``{"error": "<type>: <message>"}``.

A process per engine: vLLM keeps process-wide state (the plugin's
registration, torch.distributed), and stock vLLM runs with VLLM_PLUGINS=
(empty) so that the plugin never loads.
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kw = {}
    if "entmaxkv" in args:
        kw["additional_config"] = {"entmaxkv": args["entmaxkv"]}
    if "max_num_batched_tokens" in args:
        kw["max_num_batched_tokens"] = args["max_num_batched_tokens"]
    llm = LLM(model=args["model"], skip_tokenizer_init=True, dtype="float32",
              max_model_len=args.get("max_model_len", 512), block_size=args["block_size"], enforce_eager=True,
              max_num_seqs=8, kv_cache_memory_bytes=64 << 20, seed=0, **kw)
    sp = SamplingParams(max_tokens=args["max_tokens"], min_tokens=args["max_tokens"], temperature=0.0,
                        detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], sp, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "extra": []}
    for p in args.get("extra_prompts", []):
        try:
            o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
            result["extra"].append({"tokens": list(o.outputs[0].token_ids)})
        except Exception as exc:  # noqa: BLE001 - the caller checks the message
            result["extra"].append({"error": f"{type(exc).__name__}: {exc}"})
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
