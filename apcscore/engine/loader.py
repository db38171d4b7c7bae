"""Which engine runs a model: the native `Engine` (engine/engine.py: paged KV cache, prefix caching, batch
invariance) or the transformers fallback `TransformersEngine` (engine/hf_engine.py), as --model-backend says
(auto: native when our decoder implements the architecture; models/architecture.choose_model_backend).

Both engines have the same interface (run, counters, info, tokenizer, numerics, ...); this module is the only
place that knows both.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from apcscore.config import EngineConfig
from apcscore.errors import ApcscoreError
from apcscore.engine.engine import Engine
from apcscore.engine.hf_engine import TransformersEngine
from apcscore.engine.model_files import LoadedModel, loaded
from apcscore.engine.devices import check_backend_device, resolve_device, resolve_dtype
from apcscore.engine.model_info import context_length
from apcscore.models.architecture import choose_model_backend
from apcscore.models.decoders import decoder_class

AnyEngine = Union[Engine, TransformersEngine]


def load_engine(model: LoadedModel | str, config: EngineConfig | None = None,
                reference: LoadedModel | str | None = None) -> AnyEngine:
    """Build the engine that runs `model` (a `load_model` value, or a spec for it: alias, Hugging Face folder or
    .gguf path): the native `Engine` or the transformers fallback, as --model-backend says.

    The device checks are made here, once, before the model is located: a Triton backend without a GPU and
    --device cuda without one are refused before any weights are read; so is an architecture no path runs.
    reference: a reference model beside it (score --reference-model; engine/reference.py), native only.
    """
    config = config or EngineConfig()
    check_backend_device(config)
    resolve_dtype(config.dtype, resolve_device(config.device))
    model = loaded(model)
    if reference is not None:
        from apcscore.engine.reference import load_paired_engine

        return load_paired_engine(model, reference, config)
    if choose_model_backend(model.config, config.model_backend) == "transformers":
        check_single_device(model.config, config)
        return TransformersEngine.from_model(model, config)
    return Engine.from_model(model, config)


def check_single_device(hf_config: Any, config: EngineConfig) -> None:
    """Refuse --tensor-parallel N > 1 for a model the transformers fallback runs (it runs on one device)."""
    if config.tensor_parallel_size > 1:
        name = getattr(hf_config, "model_type", None) or "this architecture"
        raise ApcscoreError(f"--tensor-parallel {config.tensor_parallel_size} needs the native engine, and {name} "
                            "runs through the transformers fallback (one device); run it with --tensor-parallel 1")


def engine_from_parts(hf_config: Any, state_dict: dict[str, torch.Tensor], tokenizer: Any,
                      config: EngineConfig | None = None, name: str = "custom", path: str = "",
                      fingerprint: str = "", rope: Any = None, consume_state: bool = False) -> AnyEngine:
    """Build the engine that runs hf_config from a Hugging Face config and state dict (tests, benchmarks,
    random weights); the arguments are `Engine.from_parts`' (the transformers fallback ignores rope and
    consume_state)."""
    config = config or EngineConfig()
    if choose_model_backend(hf_config, config.model_backend) == "transformers":
        check_single_device(hf_config, config)
        return TransformersEngine.from_parts(hf_config, state_dict, tokenizer, config, name=name, path=path,
                                             fingerprint=fingerprint)
    return Engine.from_parts(hf_config, state_dict, tokenizer, config, name=name, path=path,
                             fingerprint=fingerprint, rope=rope, consume_state=consume_state)


def engine_context_length(hf_config: Any, config: EngineConfig) -> int:
    """The context length of the engine `load_engine` builds for `hf_config`, without building it (the Ray
    executor's jobs and partitioning, before any replica answers): engine/model_info.context_length, capped by
    a sliding window that the native decoder does not mask itself."""
    if choose_model_backend(hf_config, config.model_backend) == "transformers":
        return context_length(hf_config, config)
    return context_length(hf_config, config, not decoder_class(hf_config).implements_sliding_window)
