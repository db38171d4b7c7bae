"""Compute kernels: Triton kernels for CUDA (also run on the CPU under TRITON_INTERPRET=1 in tests), each
with its torch twin beside it (`<kernel>_torch.py`: the path the CPU engine runs, and the kernel's reference;
RMSNorm's is rowmath.rms_norm), and the CPU's C kernels (built by cpu_library.py). Kernels are leaves: they
import nothing from apcscore but each other. Only the Triton modules import Triton, so a kernel is imported from
its own module.
"""
