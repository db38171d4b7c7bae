"""The transformers fallback (issue 18): architectures our decoder does not implement run through the model's own
transformers forward and generate(), with the same output schema, and say so (metadata, one warning line).

Reference: transformers itself, loading the same tiny random directory. Tolerance: fp32 CPU logprobs within
1e-4 (the fallback computes the same forward; the only differences are the logprob arithmetic's).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from apcscore import EngineConfig, Request, SamplingParams
from apcscore.cli import app
from apcscore.engine.hf_engine import NO_CACHE_WARNING, TransformersEngine
from apcscore.engine.loader import load_engine

TOL = 1e-4  # fp32 CPU logprobs
PROMPTS = [{"id": "a", "prompt": "The quick brown fox jumps over the lazy dog."},
           {"id": "b", "prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[n - 1, V] fp32 log-softmax of the logits predicting tokens 1 .. n - 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def meta_of(path) -> dict:
    return json.loads(pq.read_table(path).schema.metadata[b"apcscore"])


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_score_through_the_fallback_matches_transformers(arch, tmp_path, write_jsonl, tiny_model_dir):
    model_dir = tiny_model_dir(arch)
    data = write_jsonl(tmp_path / "d.jsonl", PROMPTS)
    out = tmp_path / "s.parquet"
    res = invoke("score", data, "--model", model_dir, "--prompt-logprobs", 3, "--device", "cpu", "--out", out)
    assert res.exit_code == 0, res.output
    assert res.output.count("without the prefix cache") == 1  # the one warning line
    meta = meta_of(out)
    assert meta["model_backend"] == "transformers" and meta["attention_backend"] == "transformers"
    assert meta["engine"]["model_backend"] == "auto"
    assert meta["numerics"]["portable"] is False  # issue 39: its kernels follow the CPU, comparisons stay strict
    model = hf_model(model_dir)
    rows = pq.read_table(out).to_pylist()
    assert [r["status"] for r in rows] == ["ok", "ok"]
    for row in rows:
        ids = row["token_ids"]
        ref = reference_logprobs(model, ids)
        targets = torch.tensor(ids[1:])
        own = ref.gather(1, targets[:, None])[:, 0]
        got = np.array(row["token_logprobs"][1:], dtype=np.float64)
        assert np.abs(got - own.numpy()).max() < TOL
        assert row["token_ranks"][1:] == (1 + (ref > own[:, None]).sum(1)).tolist()
        assert row["top_ids"][1:] == ref.topk(3, dim=-1).indices.tolist()
        assert np.abs(np.array(row["top_logprobs"][1:]) - ref.topk(3, dim=-1).values.numpy()).max() < TOL
        assert abs(row["sum_logprob"] - float(own.sum())) < TOL * len(ids)


def test_greedy_generation_is_transformers_generate(tmp_path, write_jsonl, tiny_model_dir):
    model_dir = tiny_model_dir("gpt2")
    data = write_jsonl(tmp_path / "d.jsonl", PROMPTS)
    out = tmp_path / "g.parquet"
    res = invoke("generate", data, "--model", model_dir, "--max-tokens", 6, "--logprobs", 2, "--quiet",
                 "--device", "cpu", "--out", out)
    assert res.exit_code == 0, res.output
    model = hf_model(model_dir)
    for row in pq.read_table(out).to_pylist():
        ids = _prompt_ids(model_dir, row)
        assert row["num_prompt_tokens"] == len(ids)
        with torch.no_grad():
            expect = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        eos = model.config.eos_token_id
        if eos in expect:
            expect = expect[:expect.index(eos) + 1]
        assert row["completion_token_ids"] == expect
        # the sampled tokens' logprobs are those of the model's raw distribution
        ref = reference_logprobs(model, ids + expect)[len(ids) - 1:]
        own = ref.gather(1, torch.tensor(expect)[:, None])[:, 0].numpy()
        assert np.abs(np.array(row["completion_logprobs"]) - own).max() < TOL
        assert row["completion_ranks"] == [1] * len(expect)  # greedy
    assert meta_of(out)["model_backend"] == "transformers"


def _prompt_ids(model_dir, row) -> list[int]:
    from apcscore.models.loading import load_tokenizer

    if row["id"] == "b":
        return PROMPTS[1]["prompt_token_ids"]
    return load_tokenizer(model_dir)(PROMPTS[0]["prompt"]).input_ids


@pytest.fixture(scope="module")
def gpt2_engine(tiny_model_dir) -> TransformersEngine:
    engine = load_engine(str(tiny_model_dir("gpt2")), EngineConfig(device="cpu"))
    assert isinstance(engine, TransformersEngine) and engine.model_backend == "transformers"
    return engine


def test_seeded_sampling_is_reproducible_and_stop_strings_cut_like_the_engine(gpt2_engine):
    ids = [5, 6, 7, 8, 9, 10]
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    a, b = (next(iter(gpt2_engine.run([Request(i, ids, sampled)]))) for i in range(2))
    assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) == 8
    other = next(iter(gpt2_engine.run([Request("c", ids, SamplingParams(max_tokens=8, temperature=1.0, seed=7,
                                                                         ignore_eos=True))])))
    assert other.output_token_ids != a.output_token_ids  # the seed matters (8 tokens from 49,152)
    greedy = next(iter(gpt2_engine.run([Request("g", ids, SamplingParams(max_tokens=8, ignore_eos=True))])))
    full = greedy.output_text
    stop = full.strip()[2:5]
    assert stop.strip()
    cut = next(iter(gpt2_engine.run([Request("s", ids, SamplingParams(max_tokens=8, ignore_eos=True,
                                                                      stop=(stop,)))])))
    assert cut.finish_reason == "stop" and cut.output_text == full[:full.find(stop)]
    assert cut.output_token_ids == greedy.output_token_ids[:len(cut.output_token_ids)]
    assert len(cut.output_token_ids) <= 8


def test_request_problems_are_error_outputs(gpt2_engine):
    outs = list(gpt2_engine.run([Request("empty", []), Request("oov", [1, 10 ** 6], prompt_logprobs=0),
                                 Request("ok", [1, 2, 3], prompt_logprobs=0)]))
    assert [o.finish_reason for o in outs] == ["error", "error", None]
    assert "no tokens" in outs[0].error and "outside the vocabulary" in outs[1].error
    assert outs[2].prompt_logprobs.positions.tolist() == [1, 2]


@pytest.mark.parametrize("command", ["score", "perplexity"])
def test_a_native_model_forced_onto_the_fallback_agrees_with_the_native_path(command, tmp_path, write_jsonl,
                                                                              tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    records = PROMPTS if command == "score" else [{"id": "t", "text": "One two three four five six seven eight."}]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    files = {}
    for backend in ("native", "transformers"):
        files[backend] = tmp_path / f"{backend}.parquet"
        res = invoke(command, data, "--model", model_dir, "--backend", backend, "--prompt-logprobs", 2,
                     "--device", "cpu", "--quiet", "--out", files[backend])
        assert res.exit_code == 0, res.output
        assert meta_of(files[backend])["model_backend"] == backend
    native, fallback = (pq.read_table(files[b]).to_pylist() for b in ("native", "transformers"))
    for n, f in zip(native, fallback):
        assert (n["token_ids"] == f["token_ids"] and n["token_ranks"] == f["token_ranks"]
                and n["top_ids"] == f["top_ids"])
        lp_n = np.array([x for x in n["token_logprobs"] if x is not None])
        lp_f = np.array([x for x in f["token_logprobs"] if x is not None])
        assert lp_n.shape == lp_f.shape and np.abs(lp_n - lp_f).max() < TOL
        assert abs(n["sum_logprob"] - f["sum_logprob"]) < TOL * len(n["token_ids"])


def test_models_no_path_runs_are_still_unsupported(tmp_path, write_jsonl, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    # a non-causal model (an encoder-decoder): transformers has no causal-LM class for it
    t5 = tmp_path / "t5"
    shutil.copytree(tiny_model_dir("llama"), t5)
    cfg = json.loads((t5 / "config.json").read_text())
    cfg.update(model_type="t5", architectures=["T5ForConditionalGeneration"])
    (t5 / "config.json").write_text(json.dumps(cfg))
    res = invoke("score", data, "--model", t5, "--out", tmp_path / "x.parquet")
    assert res.exit_code == 2 and "unsupported architecture T5ForConditionalGeneration" in res.output
    assert "not a causal language model" in res.output
    # GPT-2 on the native decoder, asked for explicitly
    res = invoke("score", data, "--model", tiny_model_dir("gpt2"), "--model-backend", "native",
                 "--out", tmp_path / "x.parquet")
    assert res.exit_code == 2 and "unsupported architecture GPT2LMHeadModel" in res.output
    assert "LlamaForCausalLM" in res.output and "--model-backend transformers" in res.output
    res = invoke("score", data, "--model", tiny_model_dir("gpt2"), "--model-backend", "onnx",
                 "--out", tmp_path / "x.parquet")
    assert res.exit_code == 2 and "--model-backend must be auto, native or transformers" in res.output
    assert not (tmp_path / "x.parquet").exists()


def test_the_warning_names_what_is_missing():
    assert "prefix cache" in NO_CACHE_WARNING and "batch-invariance" in NO_CACHE_WARNING


def test_a_native_family_config_we_cannot_run_exactly_goes_to_the_fallback():
    """Long-rope is native for Phi-3 (with partial rotary too: tests/models/test_longrope.py), not for other
    families."""
    from transformers import MistralConfig, Phi3Config

    from apcscore.errors import ApcscoreError
    from apcscore.models.architecture import choose_model_backend

    longrope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                    original_max_position_embeddings=256)
    shape = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=100, max_position_embeddings=2048)
    other = MistralConfig(**shape, rope_parameters=dict(longrope), architectures=["MistralForCausalLM"])
    assert choose_model_backend(other, "auto") == "transformers"
    with pytest.raises(ApcscoreError, match="longrope.*--model-backend transformers"):
        choose_model_backend(other, "native")
    phi3 = Phi3Config(**shape, pad_token_id=0, rope_parameters=dict(longrope), architectures=["Phi3ForCausalLM"])
    assert choose_model_backend(phi3, "auto") == "native"
    partial = Phi3Config(**shape, pad_token_id=0, architectures=["Phi3ForCausalLM"],
                         rope_parameters={**longrope, "partial_rotary_factor": 0.5, "short_factor": [1.0] * 4,
                                          "long_factor": [2.0] * 4})
    assert choose_model_backend(partial, "auto") == "native"
    plain = Phi3Config(**{**shape, "max_position_embeddings": 4096}, pad_token_id=0, architectures=["Phi3ForCausalLM"])
    assert choose_model_backend(plain, "auto") == "native"


class _IdsTokenizer:
    """A tokenizer stand-in: decodes ids to their numbers (generation tests that need no vocabulary)."""

    def __init__(self, eos: int) -> None:
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def test_eos_stops_generation_unless_ignored_and_stop_token_ids_stop():
    from transformers import AutoModelForCausalLM, GPT2Config

    def engine(eos: int) -> TransformersEngine:
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=1000, bos_token_id=1,
                         eos_token_id=eos, architectures=["GPT2LMHeadModel"])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        return TransformersEngine.from_parts(cfg, model.state_dict(), _IdsTokenizer(eos), EngineConfig(device="cpu"))

    def gen(e, **params):
        return next(iter(e.run([Request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, **params))])))

    free = gen(engine(999), ignore_eos=True).output_token_ids  # the greedy continuation, 6 tokens
    assert len(free) == 6
    eos = free[3]  # make the 4th greedy token the model's eos (the weights are the same: same seed)
    e = engine(eos)
    first = free.index(eos)
    stopped = gen(e)
    assert stopped.output_token_ids == free[:first + 1] and stopped.finish_reason == "stop"
    ignored = gen(e, ignore_eos=True)
    assert ignored.output_token_ids == free and ignored.finish_reason == "length"
    by_id = gen(e, ignore_eos=True, stop_token_ids=(free[0],))
    assert by_id.output_token_ids == free[:1] and by_id.finish_reason == "stop"


def test_a_prompt_as_long_as_the_context_generates_one_token_as_on_the_native_path(tiny_model_dir):
    """A prompt of exactly the context's length still has the logits of its last position: one token, finish
    'length', as the native engine (and vLLM) gives; a prompt one token shorter gets one too (crashed the run:
    transformers refuses max_new_tokens=0)."""
    model_dir = str(tiny_model_dir("llama"))
    ids = list(range(5, 15))  # 10 tokens
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for backend in ("native", "transformers"):
        engine = load_engine(model_dir, EngineConfig(device="cpu", max_model_len=10, model_backend=backend))
        outs = list(engine.run([Request("full", ids, params), Request("one-left", ids[:9], params)]))
        assert [len(o.output_token_ids) for o in outs] == [1, 1], backend
        assert [o.finish_reason for o in outs] == ["length", "length"], backend
