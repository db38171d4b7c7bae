"""lm-eval's `--model_args` and `--device` for the apcscore backend (`lmeval/model.ApcscoreLM`): which device a
run gets, and the refusal of a key the backend does not read."""

from __future__ import annotations

import sys

from apcscore.errors import ApcscoreError
from apcscore.options.commands import engine_keys


def device_args(extra: dict | None, model_args: dict) -> dict:
    """lm-eval's --device (cuda:0 unless given) without a GPU: the CPU, as hf does; a device in model_args wins."""
    extra = {k: v for k, v in (extra or {}).items() if k != "device" or "device" not in model_args}
    if isinstance(device := extra.get("device"), str) and device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            print(f"note: lm-eval's --device {device}: no CUDA device is available here; running on the CPU",
                  file=sys.stderr)
            extra["device"] = "cpu"
    return extra


def check_model_args(engine_options: dict) -> None:
    """Refuse a model_args key the backend does not read (a typo such as dtpye=float32 ran with the default, exit
    0), as lm-eval's hf refuses one; lm-eval's own max_batch_size is accepted and ignored, as batch_size is."""
    known = engine_keys() | {"max_batch_size"}
    unknown = sorted(set(engine_options) - known)
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], [*known, *_OWN_ARGS], n=1)
        raise ApcscoreError(f"--model_args {', '.join(unknown)}: not a setting of the apcscore model"
                            + (f" (did you mean {close[0]}?)" if close else "") + f" — it takes {', '.join(_OWN_ARGS)} "
                            f"and the engine settings {', '.join(sorted(engine_keys()))}")


_OWN_ARGS = ("pretrained", "max_length", "max_gen_toks", "add_bos_token", "seed", "batch_size")
