"""Test-session set-up shared by every test.

Without a GPU the kernels run on Triton's CPU interpreter. Triton picks the
interpreter when ``@triton.jit`` runs, i.e. when the kernel modules are first
imported, so the switch is set here, before any test module imports them.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
