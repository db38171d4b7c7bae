"""EngineConfig from a dict of engine options (no lm_eval import: the CLI and the backend share it).

Only keys that are fields of EngineConfig are passed (`exact_reuse` among them); other keys are ignored.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from apcscore.config import EngineConfig

# on/off flags of the command line that turn an EngineConfig switch off
_NEGATIONS = {"no_prefix_caching": "enable_prefix_caching", "no_cuda_graphs": "use_cuda_graphs",
              "no_batch_invariant": "batch_invariant"}


def engine_fields() -> frozenset[str]:
    """The names of EngineConfig's fields in this build."""
    return frozenset(f.name for f in fields(EngineConfig))


def build_engine_config(options: dict[str, Any]) -> EngineConfig:
    """EngineConfig from `options` (None values are "not given"; `no_*` flags turn their setting off).

    Keys that are not engine settings are ignored.
    """
    known = engine_fields()
    values: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key in _NEGATIONS:
            if value:
                values[_NEGATIONS[key]] = False
        elif key in known:
            values[key] = value
    return EngineConfig(**values)
