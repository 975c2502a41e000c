"""Shared fixtures: a tiny random Llama saved offline, and vLLM runs in their own processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

RUNNER = Path(__file__).with_name("run_llm.py")
PAGE = 16


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer GQA Llama (4 query / 2 KV heads, head dim 32, vocab 256), float32,
    random weights drawn wide enough that attention is peaked (entmax then has
    a sparse support), written with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=256, max_position_embeddings=1024,
                      initializer_range=0.08, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    path = tmp_path_factory.mktemp("tiny") / "llama"
    model.save_pretrained(path)
    return str(path)


def _serve(model: str, prompts, *, max_tokens: int, entmaxkv=None, stock: bool = False, block_size: int = PAGE,
          **extra) -> dict:
    """Run ``run_llm.py`` in a fresh process: stock vLLM (``stock``, plugins
    off) or vLLM with this plugin and ``entmaxkv`` settings."""
    args = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "block_size": block_size, **extra}
    if entmaxkv is not None:
        args["entmaxkv"] = entmaxkv
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING")
    if stock:
        env["VLLM_PLUGINS"] = ""
    else:
        env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run([sys.executable, str(RUNNER), json.dumps(args)], capture_output=True, text=True, env=env,
                          timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"vLLM run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _hf_generate(model_dir: str, prompts, *, max_tokens: int, policy=None, alpha=None, page_size: int = PAGE):
    """Greedy tokens from transformers: its own attention (``policy`` None)
    or the "entmaxkv" attention with an EntmaxKVCache, one prompt at a time."""
    from transformers import LlamaForCausalLM

    import entmaxkv.hf as H

    H.register()
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if policy is not None:
        model.set_attn_implementation("entmaxkv")
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        kw = {}
        if policy is not None:
            kw["past_key_values"] = H.EntmaxKVCache(model, policy=policy, alpha=alpha, page_size=page_size,
                                                    max_len=len(p) + max_tokens)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kw)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.fixture(scope="session")
def serve():
    """``serve(model, prompts, max_tokens=..., entmaxkv=... | stock=True, ...)`` -> {"tokens", "extra"}."""
    return _serve


@pytest.fixture(scope="session")
def hf_generate():
    """``hf_generate(model_dir, prompts, max_tokens=..., policy=None | Policy, alpha=...)`` -> tokens."""
    return _hf_generate
