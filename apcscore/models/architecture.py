"""The model architectures our decoder implements (apcscore.models.llama), and the check that a config is one."""

from __future__ import annotations

from typing import Any

from apcscore.errors import ApcscoreError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def check_architecture(hf_config: Any) -> str:
    """The supported architecture name of hf_config, or a clear error."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    if not archs and getattr(hf_config, "model_type", None) in by_type:
        return by_type[hf_config.model_type]
    name = ", ".join(archs) or getattr(hf_config, "model_type", "unknown")
    raise ApcscoreError(
        f"unsupported architecture {name}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
