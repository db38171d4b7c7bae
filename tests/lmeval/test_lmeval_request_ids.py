"""The lm-eval backend stores an engine output only under a request of the call that asked for it (issue 53
item 3): request ids are unique across calls, and an output of another call is an internal error raised before
anything is stored, so a stale output (an engine run left before its end) can never poison the journal or a
shared --cache."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from apcscore import EngineConfig  # noqa: E402
from apcscore.engine.loader import load_native_engine
from apcscore.lmeval.model import ApcscoreLM  # noqa: E402
from apcscore.lmeval.store import loglikelihood_key  # noqa: E402


class DictStore(dict):
    """What ApcscoreLM asks of a ResponseStore: `in`, get, put."""

    def put(self, key: str, value: object) -> None:
        self[key] = value


def test_an_output_of_another_call_is_never_stored(tiny_model_dir, monkeypatch):
    engine = load_native_engine(str(tiny_model_dir("llama")),
                                EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4))
    lm = ApcscoreLM(engine=engine, progress=False)
    store = DictStore()
    lm.use_store(store)
    real_run = engine.run
    first_outputs = []

    def keep(requests, on_step=None):
        for out in real_run(requests, on_step=on_step):
            first_outputs.append(out)
            yield out

    monkeypatch.setattr(engine, "run", keep)
    first = lm._loglikelihood_tokens([(None, [5, 6, 7], [8]), (None, [9, 10], [11, 12])])
    assert len(first_outputs) == 2 and len(store) == 2

    def stale_first(requests, on_step=None):  # the first call's output comes back in the second call
        yield first_outputs[0]
        yield from real_run(requests, on_step=on_step)

    monkeypatch.setattr(engine, "run", stale_first)
    second = [(None, [20, 21, 22], [8]), (None, [24, 25], [26, 27])]  # the same answer token as the stale one
    with pytest.raises(RuntimeError) as info:
        lm._loglikelihood_tokens(second)
    assert not any(loglikelihood_key(c + t, len(c)) in store for _, c, t in second)  # (it was stored as second[0])
    assert "not one of this call's unanswered requests" in str(info.value) and "internal error" in str(info.value)

    monkeypatch.setattr(engine, "run", real_run)  # the engine itself is fine: the second call then runs
    values = lm._loglikelihood_tokens(second)
    assert len(values) == 2 and len(store) == 4 and lm._loglikelihood_tokens(
        [(None, [5, 6, 7], [8]), (None, [9, 10], [11, 12])]) == first
