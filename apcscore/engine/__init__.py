"""The batch engine and its parts: scheduler, block manager, model runner, sampler, logprobs, CUDA graphs.

`from apcscore.engine import Engine, load_engine` works; both (torch, the model) are imported lazily, so the
light parts (the step types of engine.step, counters) can be imported without torch.
"""

__all__ = ["Engine", "load_engine"]


def __getattr__(name: str):
    if name == "Engine":
        from apcscore.engine.engine import Engine

        return Engine
    if name == "load_engine":
        from apcscore.engine.loader import load_engine

        return load_engine
    raise AttributeError(f"module 'apcscore.engine' has no attribute {name!r}")
