"""The engine interface (engine/interface.BatchEngine) is what the two engines and the Ray engine really offer, and
the model value (models/loaded.load_model) is what they are built from: a member renamed or dropped in one
implementation fails here, not in a user's run."""

from __future__ import annotations

import inspect
import re

import pytest

from apcscore.config import EngineConfig
from apcscore.engine.engine import Engine
from apcscore.engine.hf_engine import TransformersEngine
from apcscore.engine.interface import BatchEngine
from apcscore.engine.loader import load_engine
from apcscore.models.loaded import LoadedModel, load_model
from apcscore.engine.step import Request
from apcscore.errors import ApcscoreError
from apcscore.run.verify import ReuseVerifier

CFG = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)


def test_load_model_is_one_checked_value(tiny):
    model = load_model(tiny)
    assert isinstance(model, LoadedModel)
    assert model.name == tiny and model.path.is_dir() and model.vocab_size == len(model.tokenizer)


def test_load_model_refuses_before_any_weights_are_read(tmp_path):
    with pytest.raises(ApcscoreError) as err:
        load_model(str(tmp_path / "missing"))
    assert err.value.exit_code == 2


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_both_engines_are_batch_engines(tiny, tiny_model_dir, backend):
    model = load_model(tiny if backend == "native" else str(tiny_model_dir("gpt2")))
    engine = load_engine(model, EngineConfig(**CFG))
    assert type(engine) is (Engine if backend == "native" else TransformersEngine)
    assert isinstance(engine, BatchEngine)
    assert engine.model_backend == backend
    # run_recomputed gives run's outputs for the same requests (the --verify-reuse reference)
    requests = [Request(0, [1, 2, 3, 4, 5, 6], prompt_logprobs=2)]
    first = next(iter(engine.run(requests)))
    again = next(iter(engine.run_recomputed(requests)))
    assert first.prompt_logprobs.token_logprobs.tolist() == again.prompt_logprobs.token_logprobs.tolist()


def test_recompute_restores_exact_reuse(tiny):
    engine = load_engine(tiny, EngineConfig(**CFG, exact_reuse=True))
    requests = [Request(i, list(range(1, 20)), prompt_logprobs=1) for i in range(2)]
    verifier = ReuseVerifier(1.0, 0)
    for req in requests:
        verifier.observe_request(int(req.request_id), str(req.request_id), req)
    for out in engine.run(requests):
        verifier.observe_output(out)
    report = verifier.check(engine)
    assert report["requests"] == 2 and report["mismatches"] == []
    assert engine.scheduler.exact_reuse  # the run's own setting is back


def test_the_ray_engine_offers_the_interface():
    from apcscore.run.ray_engine import RayEngine

    methods = [name for name, member in inspect.getmembers(BatchEngine) if inspect.isfunction(member)
               and not name.startswith("_")]
    assert methods and all(callable(getattr(RayEngine, name, None)) for name in methods), methods
    set_in_init = inspect.getsource(RayEngine.__init__)
    assert all(re.search(rf"self\.{name}\b[^=\n]*=", set_in_init) for name in BatchEngine.__annotations__)
