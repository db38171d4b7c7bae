"""What a run's bits depend on besides its inputs: the batch-invariance verdict, the linear construction, the
start-up probe, the CPU/GPU and the BLAS settings, as the run metadata records them under `numerics`. Which of them
resume, merge, Ray replicas and the eval cache compare, and when: io/identity.py (docs/decisions.md, "A run's
identity (issue 40): the rules in full").
"""

from __future__ import annotations

import os
import platform
import re
from functools import lru_cache
from typing import Any

import torch

@lru_cache(maxsize=1)
def cpu_description() -> dict[str, str]:
    """{"vendor": "GenuineIntel" | "AuthenticAMD" | ..., "model": the CPU's name} from /proc/cpuinfo."""
    fields: dict[str, str] = {}  # the first value of each key (the first CPU's)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if "vendor_id" in fields and "model name" in fields:
                    break
    except OSError:
        pass
    return {"vendor": fields.get("vendor_id") or platform.machine(),
            "model": fields.get("model name") or platform.processor()}


@lru_cache(maxsize=1)
def blas_description() -> dict[str, Any]:
    """torch's CPU BLAS (MKL and its version, or another), and the settings that steer it."""
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", config)
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    return {"library": f"mkl {mkl.group(1)}" if mkl else (blas.group(1) if blas else "unknown"),
            "env": {k: os.environ[k] for k in ("MKL_CBWR", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                                               "ATEN_CPU_CAPABILITY") if k in os.environ}}


# The version of the portable CPU math (kernels/cpu_math.c, kernels/rowmath.py, the rope tables' functions, the
# sampler's draw): raise it with any change to them that moves a bit (and update the golden digests).
PORTABLE_MATH = "apcscore portable math v1"


def cpu_simd() -> str | None:
    """The SIMD level of apcscore's CPU kernels (cpu_gemm.simd_level), None where they cannot be built."""
    from apcscore.kernels.cpu_gemm import simd_level
    from apcscore.kernels.cpu_library import available

    return simd_level() if available() else None


def describe_numerics(device: torch.device, batch_invariant: bool, linear: str, probe: dict | None,
                      reason: str | None, portable: bool = False) -> dict[str, Any]:
    """The `numerics` metadata of an engine (see the module doc). portable: the run's bits are the same on every
    CPU (asked by the caller: the fixed-order GEMM ran, and the portable math)."""
    hardware: dict[str, Any] = {"cpu": cpu_description()}
    capability = None  # the GPU's compute capability ("sm_90")
    if device.type == "cuda":
        hardware["gpu"] = torch.cuda.get_device_name(device)
        capability = "sm_{}{}".format(*torch.cuda.get_device_capability(device))
    return {"batch_invariant": batch_invariant, "reason": reason, "linear": linear, "probe": probe,
            "portable": portable, "math": PORTABLE_MATH if portable else "torch's ops (follow the CPU's ISA)",
            "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "simd": cpu_simd() if device.type == "cpu" else None,
            "device_capability": capability, "hardware": hardware, "blas": blas_description()}


def exp(value: float) -> float:
    """exp of a per-record figure (perplexity from a mean NLL): apcscore's portable double exp where the CPU library
    is built, so the figure has the same bits on every machine (libm's differs by version and by FMA)."""
    from apcscore.kernels.rowmath import exp_scalar

    return exp_scalar(value)


def log(value: float) -> float:
    """log of a per-record figure (see exp)."""
    from apcscore.kernels.rowmath import log_scalar

    return log_scalar(value)


def exact_sum(values: Any) -> float:
    """The correctly rounded sum of float values (math.fsum): the same bits in every order and on every machine,
    and the most accurate float64 there is (a sum of per-token logprobs)."""
    import math

    return math.fsum(values.tolist() if hasattr(values, "tolist") else values)
