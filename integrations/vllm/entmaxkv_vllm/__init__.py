"""EntmaxKV attention for vLLM: a general plugin that registers the backend.

vLLM loads ``register`` from the ``vllm.general_plugins`` entry point in
every process. It registers ``entmaxkv_vllm.backend.EntmaxKVBackend`` as
vLLM's ``CUSTOM`` attention backend (CUDA: ``--attention-backend CUSTOM``)
and, on the CPU platform, which always selects ``CPU_ATTN``, in place of
that one. ``VLLM_PLUGINS=`` (empty) keeps every plugin out, stock vLLM
again. Settings: ``entmaxkv_vllm.config``.
"""
from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "entmaxkv_vllm.backend.EntmaxKVBackend"


def register() -> None:
    """Register the backend with vLLM (safe to call more than once)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
