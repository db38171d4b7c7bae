"""Phi-3 long-rope on the native decoder (apcscore.models.phi3) against transformers, and its prefix-cache rule.

transformers' semantics: every forward call uses the long frequencies at all positions when its largest position + 1
exceeds original_max_position_embeddings (M = 32 in the tiny configs, context 256), else the short ones; and
Phi3ForCausalLM's generate() drops its cache and recomputes the whole sequence when it first grows past M tokens.
So prompt scoring of a prompt of L tokens is short for L <= M and long beyond, and each generated token's logits
are those of a full forward over the sequence so far. fp32 CPU; logprobs within 1e-4 of transformers, greedy tokens
equal to generate(). The two rope variants' KV must never meet in the prefix cache or the score store: every
result here is also compared bitwise with the same request run alone in a fresh engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apcscore import Engine, EngineConfig, Request, SamplingParams
from apcscore.engine.loader import load_native_engine

M = 32  # original_max_position_embeddings of the tiny long-rope configs (tests/conftest.py)
TOL = 1e-4


@pytest.fixture(scope="module", params=["phi3_longrope", "phi3_partial"])
def pair(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def engine(path, **overrides) -> Engine:
    cfg = dict(device="cpu", dtype="float32", num_kv_blocks=256, block_size=4, max_batch_tokens=64)
    cfg.update(overrides)
    return load_native_engine(str(path), EngineConfig(**cfg))


def prompts(lengths, seed, shared=()):
    g = torch.Generator().manual_seed(seed)
    return [list(shared) + torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def ref_logprobs(hf, ids) -> np.ndarray:
    """transformers' logprob of each token 1.. of ids under one full forward: [len(ids) - 1]."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)[:-1]
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def generated_logprobs(hf, ids, start) -> np.ndarray:
    """transformers' logprob of each generated token ids[start:], each under a full forward over the tokens before it
    (what generate() computes for it): [len(ids) - start]."""
    out = []
    with torch.no_grad():
        for j in range(start, len(ids)):
            out.append(torch.log_softmax(hf(torch.tensor([ids[:j]])).logits[0, -1].float(), -1)[ids[j]].item())
    return np.array(out, dtype=np.float32)


def run(eng: Engine, requests) -> dict:
    outs = {o.request_id: o for o in eng.run(requests)}
    assert all(o.error is None for o in outs.values()), [o.error for o in outs.values()]
    return outs


def test_auto_runs_long_rope_phi3_natively(pair):
    path, _ = pair
    eng = engine(path)
    assert eng.model_backend == "native" and eng.long_rope_after == M


def test_prompt_logprobs_match_transformers_below_at_and_above_the_original_context(pair):
    path, hf = pair
    ps = prompts([9, 31, 32, 33, 50, 200], seed=1)
    for budget in (16, 64):  # chunked prefill of the long prompts: every chunk of a long prompt is long
        outs = run(engine(path, max_batch_tokens=budget), [Request(i, p, prompt_logprobs=0) for i, p in enumerate(ps)])
        for i, p in enumerate(ps):
            got = outs[i].prompt_logprobs.token_logprobs
            assert np.abs(got - ref_logprobs(hf, p)).max() < TOL, (budget, len(p))


def test_the_variants_differ_here_so_the_tests_can_fail(pair):
    """On these weights the short and long frequencies give clearly different logprobs for the same tokens."""
    _, hf = pair
    p = prompts([40], seed=2)[0]
    assert np.abs(ref_logprobs(hf, p)[:M - 1] - ref_logprobs(hf, p[:M])).max() > 1e-2


def test_generation_crossing_the_original_context_equals_generate(pair):
    """Prompts of 5, 20, 31 and 32 tokens decode 30 past M (re-prefilled long when they cross), 40 starts long;
    the sampled tokens' logprobs are those of a full forward over the sequence so far."""
    path, hf = pair
    ps = prompts([5, 20, 31, 32, 40], seed=3)
    eng = engine(path)
    outs = run(eng, [Request(i, p, sampling=SamplingParams(max_tokens=30, ignore_eos=True, logprobs=0))
                     for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0].tolist()
        assert outs[i].output_token_ids == ref[len(p):], len(p)
        want = generated_logprobs(hf, ref, len(p))
        assert np.abs(outs[i].output_logprobs.token_logprobs - want).max() < TOL, len(p)


def test_scoring_and_generating_request_keeps_its_short_prompt_logprobs(pair):
    """A 20-token prompt scored (short, like transformers' forward over the prompt) that then generates past M:
    the long re-prefill recomputes its KV only, and the prompt logprobs stay those of the prompt."""
    path, hf = pair
    p = prompts([20], seed=4)[0]
    eng = engine(path)
    out = run(eng, [Request(0, p, prompt_logprobs=2, sampling=SamplingParams(max_tokens=25, ignore_eos=True))])[0]
    assert out.prompt_logprobs.positions.tolist() == list(range(1, 20))
    assert np.abs(out.prompt_logprobs.token_logprobs - ref_logprobs(hf, p)).max() < TOL
    ref = hf.generate(torch.tensor([p]), max_new_tokens=25, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.output_token_ids == ref[0, 20:].tolist()


def columns(out) -> list[np.ndarray]:
    cols = [np.asarray(out.output_token_ids)]
    if out.output_logprobs is not None:
        cols += [out.output_logprobs.token_logprobs, out.output_logprobs.top_logprobs]
    if out.prompt_logprobs is not None:
        p = out.prompt_logprobs
        cols += [p.token_logprobs, p.ranks, p.top_ids, p.top_logprobs, p.positions]
    return cols


def assert_bitwise(got, want, what):
    for a, b in zip(columns(got), columns(want), strict=True):
        assert a.shape == b.shape and np.array_equal(a, b), what


def test_short_and_long_sequences_sharing_a_prefix_stay_correct_in_the_prefix_cache(pair):
    """Generation requests read the prefix cache. A short (26 + 6 generated tokens: never past M) and a long
    (54-token) prompt share 24 tokens: the same tokens' KV differs between them, so neither may read the other's
    blocks; a 30-token prompt that crosses M while generating is re-prefilled long and may read the long one's
    blocks (and the long one its). Each in every order is bitwise what it gives alone in a fresh engine, and
    within 1e-4 of transformers."""
    path, hf = pair
    shared = prompts([24], seed=5)[0]
    short, long, cross = prompts([2, 30, 6], seed=6, shared=shared)  # 26, 54, 30 tokens
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    reqs = {"short": Request("short", short, sampling=params), "long": Request("long", long, sampling=params),
            "cross": Request("cross", cross, sampling=params)}
    alone = {k: run(engine(path), [r])[k] for k, r in reqs.items()}
    for k, r in reqs.items():
        full = hf.generate(torch.tensor([r.prompt_token_ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0].tolist()
        assert alone[k].output_token_ids == full[len(r.prompt_token_ids):], k
        want = generated_logprobs(hf, full, len(r.prompt_token_ids))
        assert np.abs(alone[k].output_logprobs.token_logprobs - want).max() < TOL, k
    for order in (["short", "long", "cross"], ["long", "short", "cross"], ["cross", "long", "short"]):
        eng = engine(path, max_num_seqs=1)  # one at a time: each later one finds the earlier ones' blocks cached
        outs = run(eng, [reqs[k] for k in order])
        for k in order:
            assert_bitwise(outs[k], alone[k], (order, k))
        hits = {k: outs[k].num_cached_tokens for k in order}
        first = order[0]
        assert hits[first] == 0
        # a short and a long prompt never hit each other's blocks; two of the same variant do
        if order[:2] == ["short", "long"] or order[:2] == ["long", "short"]:
            assert hits[order[1]] == 0, order
        both = engine(path, max_num_seqs=1)
        again = run(both, [reqs[first], Request("again", reqs[first].prompt_token_ids, sampling=params)])
        n = len(reqs[first].prompt_token_ids)
        assert again["again"].num_cached_tokens == (n - 1) // 4 * 4  # every full block but the last token's
        assert_bitwise(again["again"], alone[first], "same prompt again, cached")


def test_exact_reuse_score_store_keeps_the_variants_apart(pair):
    """--exact-reuse: scoring requests read cached blocks and stored scores. A short and a long prompt sharing
    24 tokens, scored one after the other in both orders: each is bitwise its score alone."""
    path, hf = pair
    shared = prompts([24], seed=7)[0]
    short, long = prompts([4, 30], seed=8, shared=shared)
    reqs = [Request("short", short, prompt_logprobs=2), Request("long", long, prompt_logprobs=2)]
    alone = {r.request_id: run(engine(path, exact_reuse=True), [r])[r.request_id] for r in reqs}
    for r in reqs:
        assert np.abs(alone[r.request_id].prompt_logprobs.token_logprobs
                      - ref_logprobs(hf, r.prompt_token_ids)).max() < TOL
    for order in (reqs, reqs[::-1]):
        eng = engine(path, exact_reuse=True, max_num_seqs=1)
        outs = run(eng, order + [Request("again", order[0].prompt_token_ids, prompt_logprobs=2)])
        for r in order:
            assert_bitwise(outs[r.request_id], alone[r.request_id], [x.request_id for x in order])
        assert_bitwise(outs["again"], alone[order[0].request_id], "again")
        assert outs["again"].num_cached_tokens > 0  # the same variant is read (served from the store)
        assert outs[order[1].request_id].num_cached_tokens == 0  # the other variant is not


def test_a_long_rope_config_of_another_family_is_refused_natively():
    """Only Phi-3's long-rope is implemented: a Llama config with rope type longrope goes to the fallback."""
    from transformers import LlamaConfig

    from apcscore.errors import ApcscoreError
    from apcscore.models.architecture import choose_model_backend

    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                original_max_position_embeddings=32)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=100, max_position_embeddings=256, rope_parameters=rope,
                      architectures=["LlamaForCausalLM"])
    assert choose_model_backend(cfg, "auto") == "transformers"
    with pytest.raises(ApcscoreError, match="longrope.*only Phi-3"):
        choose_model_backend(cfg, "native")


def test_partial_rotary_with_default_rope_matches_transformers(tmp_path, default_tokenizer):
    """Partial rotary without long-rope (Phi-3's own default frequencies over the rotated dimensions), loaded twice:
    the second load reads the remembered config (apcscore.models.loaded) and must give the same bits."""
    from transformers import AutoModelForCausalLM, Phi3Config

    cfg = Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, max_position_embeddings=256, initializer_range=0.2,
                     vocab_size=len(default_tokenizer), pad_token_id=0, sliding_window=None,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ps = prompts([9, 60], seed=9)
    first = run(engine(tmp_path), [Request(i, p, prompt_logprobs=0) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert np.abs(first[i].prompt_logprobs.token_logprobs - ref_logprobs(hf, p)).max() < TOL
    again = run(engine(tmp_path), [Request(i, p, prompt_logprobs=0) for i, p in enumerate(ps)])
    for i in range(len(ps)):
        assert_bitwise(again[i], first[i], "second load")
