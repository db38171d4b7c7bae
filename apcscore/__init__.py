"""apcscore: batch scoring and evaluation of causal language models.

The Python API the CLI itself uses::

    from apcscore import EngineConfig, Request, SamplingParams, load_engine
    engine = load_engine("smollm2-135m", EngineConfig())  # the native Engine, or the transformers fallback
    for out in engine.run([Request("a", engine.tokenizer("Hello").input_ids, prompt_logprobs=5)]):
        print(out.request_id, out.prompt_logprobs.token_logprobs)
"""

__version__ = "0.1.0"

from apcscore.config import EngineConfig
from apcscore.engine.step import Request, RequestOutput, SamplingParams, TokenLogprobs

__all__ = [
    "Engine",
    "EngineConfig",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprobs",
    "__version__",
    "load_engine",
]


def __getattr__(name: str):
    # Engine pulls in torch and transformers; import it lazily so `apcscore --help` stays fast.
    if name == "Engine":
        from apcscore.engine.engine import Engine

        return Engine
    if name == "load_engine":
        from apcscore.engine.loader import load_engine

        return load_engine
    raise AttributeError(name)
