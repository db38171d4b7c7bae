"""Where the Triton tests run: on CUDA, or on the CPU under TRITON_INTERPRET=1 (`make test` sets it); skipped
otherwise. `TRITON_MARKS` is a Triton test module's `pytestmark`."""

from __future__ import annotations

import pytest
import torch

from apcscore.kernels._checks import interpreting

INTERPRET = interpreting()
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"

needs_triton = pytest.mark.skipif(not INTERPRET and not HAS_CUDA,
                                  reason="Triton needs CUDA; on a CPU set TRITON_INTERPRET=1 (make test does)")
TRITON_MARKS = [pytest.mark.triton, needs_triton]
