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
    # Engine pulls in torch and transformers: apcscore.engine imports it lazily, so `apcscore --help` stays fast.
    import apcscore.engine

    if name in apcscore.engine.__all__:
        return getattr(apcscore.engine, name)
    raise AttributeError(f"module 'apcscore' has no attribute {name!r}")
