"""The batch engine and its parts: scheduler, block manager, model runner, sampler, logprobs, CUDA graphs.

`from apcscore.engine import Engine` works; Engine (torch, the model) is imported lazily, so the light
parts (sampling_params, sequence) can be imported without torch.
"""

__all__ = ["Engine"]


def __getattr__(name: str):
    if name == "Engine":
        from apcscore.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'apcscore.engine' has no attribute {name!r}")
