"""What the rest of apcscore may use of an engine: `BatchEngine`, the interface that the native `Engine`
(engine/engine.py) and the transformers fallback `TransformersEngine` (engine/hf_engine.py) both offer.

The run layer, the jobs' runner, the run metadata and the lm-eval adapter are typed with it; anything else on an
engine (its scheduler, block manager, model) is the engine's own.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch

from apcscore.config import EngineConfig
from apcscore.engine.counters import EngineCounters
from apcscore.engine.step import Request, RequestOutput
from apcscore.models.loaded import LoadedModel


@runtime_checkable
class BatchEngine(Protocol):
    """An engine: requests in, one output per request out, in completion order."""

    model_backend: str  # "native" | "transformers", as the run metadata records it
    attention_backend: str  # "torch" | "triton" | "transformers"
    tokenizer: Any  # a transformers tokenizer
    config: EngineConfig
    info: LoadedModel  # the model it runs, its facts filled in: architecture, fingerprint, context length, ...
    device: torch.device
    dtype: torch.dtype
    numerics: dict  # the run metadata's numerics section (batch invariance, GEMM, portable bits)
    batch_invariant: bool  # whether a record's scores are independent of what shares its steps

    def run(self, requests: Iterable[Request], on_step: Callable[[Any], None] | None = None
            ) -> Iterator[RequestOutput]:
        """Every request's output, in completion order; `on_step(engine)` after each step (it may raise)."""
        ...

    def run_recomputed(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        """`run` with every scored position computed by a full prefill, whatever --exact-reuse says (the
        reference of --verify-reuse)."""
        ...

    def counters(self) -> EngineCounters:
        """The counters since the engine was built (timings, tokens, prefix-cache hits, the KV pool)."""
        ...
