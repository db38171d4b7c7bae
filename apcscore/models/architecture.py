"""The model architectures our decoder implements (apcscore.models.llama), which other causal LMs the
transformers fallback runs (apcscore.engine.hf_engine), and the checks that pick between them."""

from __future__ import annotations

from typing import Any

from apcscore.errors import ApcscoreError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GPTNeoXForCausalLM": "gpt_neox",  # apcscore.models.gpt_neox
    "Olmo2ForCausalLM": "olmo2",  # apcscore.models.olmo2
    "Phi3ForCausalLM": "phi3",  # apcscore.models.phi3 (long-rope, partial rotary)
    "MixtralForCausalLM": "mixtral",  # apcscore.models.moe
    "Qwen2MoeForCausalLM": "qwen2_moe",  # apcscore.models.moe
    "Gemma2ForCausalLM": "gemma2",  # apcscore.models.gemma
    "Gemma3ForCausalLM": "gemma3",  # apcscore.models.gemma (text only)
}
# the families whose rotary tables are Llama's (apcscore.models.rope; resolved and remembered ahead)
LLAMA_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "mixtral", "qwen2_moe"})

MODEL_BACKENDS = ("auto", "native", "transformers")


def _name(hf_config: Any) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    return ", ".join(archs) or str(getattr(hf_config, "model_type", "unknown"))


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """A copy of the config's rope_parameters ({} when it has none)."""
    return dict(getattr(hf_config, "rope_parameters", None) or {})


def native_architecture(hf_config: Any) -> str | None:
    """The architecture name of hf_config if our own decoder runs it, else None."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    if not archs and getattr(hf_config, "model_type", None) in by_type:
        return by_type[hf_config.model_type]
    return None


def native_problem(hf_config: Any) -> str | None:
    """Why our decoder of a native architecture cannot run this particular config exactly, or None."""
    family = SUPPORTED_ARCHITECTURES.get(native_architecture(hf_config) or "")
    if family in LLAMA_FAMILIES:
        kind = rope_parameters(hf_config).get("rope_type", "default")
        if family == "phi3" and kind not in ("default", "longrope"):
            return f"Phi-3 with rope type {kind!r} is not implemented natively"
        if family != "phi3" and kind == "longrope":  # the length switch lives in apcscore.models.phi3
            return f"{_name(hf_config)} with rope type 'longrope' is not implemented natively (only Phi-3's is)"
    if family in ("gemma2", "gemma3"):
        if getattr(hf_config, "use_bidirectional_attention", False):
            return "Gemma with bidirectional attention is not implemented natively"
        rope = rope_parameters(hf_config)
        kinds = [r.get("rope_type", "default") for r in rope.values() if isinstance(r, dict)] or [
            rope.get("rope_type", "default")]  # Gemma 3: one entry per layer type; Gemma 2: one rope
        for kind in kinds:
            if "dynamic" in kind or kind == "longrope":
                return f"Gemma with rope type {kind!r} is not implemented natively"
    return None


def check_architecture(hf_config: Any) -> str:
    """The native architecture name of hf_config, or a clear error (the native decoder cannot run it)."""
    arch = native_architecture(hf_config)
    problem = native_problem(hf_config) if arch is not None else (
        f"unsupported architecture {_name(hf_config)} for the native decoder; native: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if problem:
        raise ApcscoreError(f"{problem} — use --model-backend transformers (or auto) to run it through "
                            f"transformers, without the prefix cache")
    return arch


def is_causal_lm(hf_config: Any) -> bool:
    """Whether transformers has a causal-LM class for hf_config's model type (what the fallback needs)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(hf_config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def choose_model_backend(hf_config: Any, model_backend: str = "auto") -> str:
    """"native" or "transformers": the path that runs hf_config under --model-backend; a clear error if none can.

    auto: native when our decoder implements the architecture, else transformers when it is a causal LM.
    """
    if model_backend not in MODEL_BACKENDS:
        raise ApcscoreError(f"--model-backend must be auto, native or transformers, not {model_backend!r}")
    native = native_architecture(hf_config) is not None and native_problem(hf_config) is None
    if model_backend == "native" or (model_backend == "auto" and native):
        check_architecture(hf_config)
        return "native"
    if not is_causal_lm(hf_config):
        raise ApcscoreError(
            f"unsupported architecture {_name(hf_config)}: not a causal language model (transformers has no "
            f"AutoModelForCausalLM class for model type {getattr(hf_config, 'model_type', None)!r}); natively "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}, and any causal LM through transformers"
        )
    return "transformers"
