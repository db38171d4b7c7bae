"""What a run's bits depend on besides its inputs: the batch-invariance verdict, the linear construction, the
start-up probe, the CPU/GPU and the BLAS settings, as the run metadata records them under `numerics`.

batch_invariant, linear, cpu_capability and device_capability must agree for shards to be merged and runs to be
resumed (apcscore.io.provenance leaves the rest out): `hardware` and `blas` describe the machine (a construction by
design gives the same bits on another CPU model; the probe re-checks it there), and `torch_threads` changes no bit.
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
    vendor, model = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "model name" and not model:
                    model = value.strip()
                if vendor and model:
                    break
    except OSError:
        pass
    return {"vendor": vendor or platform.machine(), "model": model or platform.processor()}


@lru_cache(maxsize=1)
def blas_description() -> dict[str, Any]:
    """torch's CPU BLAS (MKL and its version, or another), and the settings that steer it."""
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", config)
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    return {"library": f"mkl {mkl.group(1)}" if mkl else (blas.group(1) if blas else "unknown"),
            "env": {k: os.environ[k] for k in ("MKL_CBWR", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                                               "ATEN_CPU_CAPABILITY") if k in os.environ}}


def device_capability(device: torch.device) -> str | None:
    """The GPU's compute capability ("sm_90") for CUDA devices, else None."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def describe_numerics(device: torch.device, batch_invariant: bool, linear: str, probe: dict | None,
                      reason: str | None) -> dict[str, Any]:
    """The `numerics` metadata of an engine (see the module doc)."""
    hardware: dict[str, Any] = {"cpu": cpu_description()}
    if device.type == "cuda":
        hardware["gpu"] = torch.cuda.get_device_name(device)
    return {"batch_invariant": batch_invariant, "reason": reason, "linear": linear, "probe": probe,
            "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "device_capability": device_capability(device), "hardware": hardware, "blas": blas_description()}
