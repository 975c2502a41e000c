"""Fused causal attention for prefill (softmax and alpha-entmax), flash style.

``causal_attention(q, k, v, *, alpha, scale, slopes=None, config=None, out=None)``
attends the last Tq of Tk positions causally with GQA and per-head ALiBi
slopes, never forming a Tq x Tk score tensor; ``PrefillConfig`` holds its
launch choices and solver settings. flash.py has the kernels and their
design, launch.py the checks and the launch.
"""
from .launch import PrefillConfig, causal_attention

__all__ = ["PrefillConfig", "causal_attention"]
