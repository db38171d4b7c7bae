"""The device and dtype of a run (`--device`, `--dtype`), and the refusal of a backend the device cannot run."""

from __future__ import annotations

import os

import torch

from apcscore.config import EngineConfig
from apcscore.errors import ApcscoreError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_and_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The torch device of --device and dtype of --dtype (auto: bfloat16 on CUDA, float32 on the CPU)."""
    device = resolve_device(config.device)
    if config.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, DTYPES[config.dtype]


def resolve_device(device: str) -> torch.device:
    """The torch device of --device (auto: CUDA when available, else the CPU); an error for CUDA without
    one."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ApcscoreError("--device cuda was asked for, but no CUDA device is available; use --device cpu")
    return torch.device(device)


def check_backend_device(config: EngineConfig) -> None:
    """Refuse --attention-backend triton where no GPU runs it (the Triton interpreter, for tests,
    excepted)."""
    if config.attention_backend == "triton" and resolve_device(config.device).type != "cuda" \
            and os.environ.get("TRITON_INTERPRET") != "1":
        raise ApcscoreError("--attention-backend triton needs a CUDA GPU, and this run is on the CPU — use "
                            "--attention-backend torch (or auto, which picks torch on a CPU)")
