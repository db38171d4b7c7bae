"""What transformers' GGUF loader can read: the architectures it knows, and the settings a GGUF file states
that its reading leaves out (the model then runs with the config class's default instead).

apcscore converts a GGUF file through transformers (apcscore.models.gguf_cache), so transformers' reading of
the file is the model we run; these checks only say where that reading and the file disagree, so the user can
be warned. Nothing heavy is imported at module level.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# GGUF key (after "<arch>.") -> the transformers config attribute the same setting lives in
_SAME_SETTING = {
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "attention.sliding_window": "sliding_window",
    "attention.key_length": "head_dim",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


def transformers_gguf_architectures() -> list[str]:
    """The GGUF `general.architecture` values the installed transformers can load (best effort: [] if unknown)."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return []
    names = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}  # key groups of the same table
    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS  # newer transformers' second GGUF path

        names |= set(GGUF_CONFIG_ARCHS)
    except ImportError:
        pass
    return sorted(names)


def _metadata(gguf: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
    """(metadata, tensor names) of a GGUF file; string arrays (the vocabulary) are not decoded."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata  # fast: no vocabulary decoding
    except ImportError:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf))
        metadata = {name: field.contents() for name, field in reader.fields.items() if len(field.data) == 1}
        return metadata, tuple(t.name for t in reader.tensors)
    return read_gguf_metadata(str(gguf))


def _differs(stated: Any, used: Any) -> bool:
    if isinstance(stated, (int, float)) and isinstance(used, (int, float)):
        return not math.isclose(float(stated), float(used), rel_tol=1e-6)  # the file stores float32
    return stated != used


def dropped_settings(gguf: Path, config: dict[str, Any]) -> list[str]:
    """The settings `gguf` states that the converted `config` (config.json's dict) does not follow, in words."""
    metadata, tensor_names = _metadata(gguf)
    arch = metadata.get("general.architecture", "")
    dropped = []
    if "rope_freqs.weight" in tensor_names:
        dropped.append("rope_freqs.weight (per-frequency rope factors, e.g. Llama 3.1+ 'llama3' rope scaling): "
                       "transformers runs plain rope")
    if "rope_factors_long.weight" in tensor_names:
        dropped.append("rope_factors_long.weight / rope_factors_short.weight (Phi-3 long-rope): transformers "
                       "runs plain rope")
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    rope = config.get("rope_parameters") or {}
    kinds = {r.get("rope_type") for r in rope.values() if isinstance(r, dict)} | {rope.get("rope_type")}
    if scaling not in (None, "none") and scaling not in kinds:
        factor = metadata.get(f"{arch}.rope.scaling.factor")
        dropped.append(f"{arch}.rope.scaling.type = {scaling} (factor {factor}): transformers runs "
                       f"{', '.join(sorted(str(k) for k in kinds if k)) or 'default'} rope")
    for key, attr in _SAME_SETTING.items():
        stated = metadata.get(f"{arch}.{key}")
        if stated is not None and attr in config and _differs(stated, config[attr]):
            dropped.append(f"{arch}.{key} = {stated}: transformers runs {attr} = {config[attr]}")
    return dropped
