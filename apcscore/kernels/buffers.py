"""This thread's reusable buffers, by use: the [rows, vocab] temporaries of the CPU logprob path (the logits, their
log_softmax, the rank comparison) and the workspaces of the CPU's C kernels (kernels/cpu_gemm.py).

Why reuse: a fresh tensor of more than 32 MiB comes from its own mmap, so the kernel faults in and zeroes every
4 KiB page of it each time: a [1024, 49152] fp32 chunk is 50,000 page faults. A reused buffer gives the same bits,
faster (measured: docs/benchmarks.md); smaller temporaries are kept by malloc (engine/host_memory.py).

Per thread: two engines in two threads never share a buffer (a regrow in one would free the other's under it; ctypes
releases the GIL during a kernel call). Buffers alive at the same time need their own uses (a model's logits and its
reference model's: "logits", "reference logits"). A buffer lives as long as its thread, grown to the largest size
asked of it.
"""

from __future__ import annotations

import math
import threading

import torch

_buffers = threading.local()


def reused_buffer(use: str, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised `shape` tensor of `dtype`: a view of this thread's buffer for `use` (grown when too small)."""
    size = math.prod(shape) * dtype.itemsize
    buf = getattr(_buffers, use, None)
    if buf is None or buf.device != torch.device(device) or buf.numel() < size:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        setattr(_buffers, use, buf)
    return buf[:size].view(dtype).view(shape)
