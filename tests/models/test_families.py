"""The sparse-MoE (Mixtral, Qwen2-MoE) and Gemma 2/3 decoders beyond what tests/engine/test_engine.py checks for
every family (logits within 1e-4 of transformers, prompt logprobs, greedy generation):

- a MoE token's result does not depend on the other tokens routed with it (bitwise), and both checkpoint
  layouts (per-expert tensors, transformers 5's stacked experts) load to the same bits;
- Gemma against transformers on prompts many times its window (the window crossing key tiles), in chunks, and
  greedy generation well past the window; the engine does not cap Gemma's context at the window;
- Gemma builds on the Triton attention backend; what the native path refuses (bidirectional or dynamic-rope
  Gemma configs).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from apcscore import EngineConfig, Request, SamplingParams
from apcscore.engine import Engine
from apcscore.engine.loader import load_native_engine, native_engine_from_parts
from apcscore.errors import ApcscoreError


def make_engine(model_dir, **overrides) -> Engine:
    cfg = dict(device="cpu", dtype="float32", num_kv_blocks=256, block_size=4, max_batch_tokens=64)
    cfg.update(overrides)
    return load_native_engine(str(model_dir), EngineConfig(**cfg))


def random_prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_a_moe_tokens_result_does_not_depend_on_its_batch(tiny_model_dir, arch):
    """Rows routed alone and inside a batch of 37 (other tokens sharing their experts' GEMMs): the same bits."""
    engine = make_engine(tiny_model_dir(arch))
    moe = engine.model.layers[0].mlp
    x = torch.randn(37, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        together = moe(x)
        weights, experts = moe.route(x)
        assert len(torch.unique(experts)) == moe.num_experts  # every expert got tokens: the loop is exercised
        for i in (0, 5, 36):
            assert torch.equal(moe(x[i:i + 1])[0], together[i])


def other_layout(state: dict[str, torch.Tensor], arch: str, inter: int, num: int) -> dict[str, torch.Tensor]:
    """The same MoE weights in the other checkpoint layout: per-expert tensors (Mixtral's under
    `block_sparse_moe.`) <-> transformers 5's stacked `mlp.experts.gate_up_proj` / `down_proj`."""
    g, u, d = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    stacked = any(name.endswith("experts.gate_up_proj") for name in state)
    legacy = (lambda n: n.replace(".mlp.", ".block_sparse_moe.")) if arch == "mixtral" else (lambda n: n)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if stacked and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = legacy(name.rsplit(".", 1)[0])  # "model.layers.N.<mlp>.experts"
            for e in range(t.shape[0]):
                if name.endswith("down_proj"):
                    out[f"{base}.{e}.{d}.weight"] = t[e].clone()
                else:
                    out[f"{base}.{e}.{g}.weight"] = t[e, :inter].clone()
                    out[f"{base}.{e}.{u}.weight"] = t[e, inter:].clone()
        elif not stacked and ".experts." in name and ".shared_expert" not in name:
            base, rest = name.split(".experts.", 1)
            base = base.replace(".block_sparse_moe", ".mlp") + ".experts."
            e, kind = int(rest.split(".")[0]), rest.split(".")[1]
            if kind == d:
                out.setdefault(base + "down_proj", torch.zeros(num, *t.shape))[e] = t
            else:
                gate_up = out.setdefault(base + "gate_up_proj", torch.zeros(num, 2 * inter, t.shape[1]))
                (gate_up[e, :inter] if kind == g else gate_up[e, inter:]).copy_(t)
        elif arch == "mixtral" and (".mlp.gate." in name or ".block_sparse_moe.gate." in name):
            out[legacy(name) if stacked else name.replace(".block_sparse_moe.", ".mlp.")] = t
        else:
            out[name] = t
    assert set(out) != set(state)
    return out


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_checkpoint_layouts_load_to_the_same_bits(tiny_model_dir, default_tokenizer, arch):
    """Per-expert tensors (the Hub's Mixtral `block_sparse_moe.experts.N.w1/w2/w3`, Qwen2-MoE's
    `mlp.experts.N.gate_proj/...`) and the stacked `mlp.experts.gate_up_proj`/`down_proj` give the same model."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = tiny_model_dir(arch)
    config = AutoConfig.from_pretrained(path)
    state = load_file(str(path / "model.safetensors"))
    inter = config.intermediate_size if arch == "mixtral" else config.moe_intermediate_size
    num = config.num_local_experts if arch == "mixtral" else config.num_experts
    prompt = random_prompt(40, seed=1)
    outs = []
    for weights in (state, other_layout(state, arch, inter, num)):
        engine = native_engine_from_parts(config, weights, default_tokenizer,
                                          EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4))
        (out,) = engine.run([Request(0, prompt, prompt_logprobs=3)])
        outs.append(out.prompt_logprobs.token_logprobs)
    assert (outs[0] == outs[1]).all()


def _hf(path):
    """The reference: transformers' eager attention. Its SDPA path drops Gemma 2's attention soft-cap in
    transformers 5.17 (the H200's version; 5.24 refuses SDPA for Gemma 2), 13 nats off on the tiny model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_long_prompts_match_transformers_across_windows(tiny_model_dir, arch):
    """Prompts of 200 and 333 tokens (windows 24 and 70, so the window crosses several key tiles), chunked by a
    32-token budget: prompt logprobs within 1e-4 of transformers; greedy generation 40 tokens past them
    equals generate()."""
    path = tiny_model_dir(arch)
    hf = _hf(path)
    engine = make_engine(path, max_batch_tokens=32)
    assert engine.info.max_model_len == 2048 and engine.info.sliding_window is None  # not capped at the window
    prompts = [random_prompt(n, seed=n) for n in (200, 333)]
    outs = {o.request_id: o for o in engine.run(Request(i, p, prompt_logprobs=1) for i, p in enumerate(prompts))}
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)[:-1]
        ref_lp = ref.gather(1, torch.tensor(p[1:])[:, None])[:, 0].numpy()
        assert abs(outs[i].prompt_logprobs.token_logprobs - ref_lp).max() < 1e-4
    gen = {o.request_id: o.output_token_ids for o in engine.run(
        Request(i, p[:90], sampling=SamplingParams(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts))}
    for i, p in enumerate(prompts):
        ref = hf.generate(torch.tensor([p[:90]]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, 90:].tolist()
        assert gen[i] == ref


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_builds_on_the_triton_attention_backend(tiny_model_dir, arch):
    """No refusal (docs/errors.md row 80, retired): the Triton kernel masks the window and soft-caps, and each
    layer hands its window / soft-cap to the backend (tests/engine/test_triton_engine.py runs it against
    transformers)."""
    from transformers import AutoConfig

    from apcscore.models.ops import Ops
    from apcscore.models.gemma import GemmaDecoder

    config = AutoConfig.from_pretrained(tiny_model_dir(arch))
    triton = Ops("triton", lambda *a, **k: None, True, SimpleNamespace(name="triton"), None, None)
    model = GemmaDecoder(config, triton, device="meta")
    attn = [layer.self_attn for layer in model.layers]
    assert all(a.attention_backend is triton.attention for a in attn)
    assert [a.window for a in attn] == [config.sliding_window if t == "sliding_attention" else None
                                        for t in config.layer_types]
    assert [a.softcap for a in attn] == ([5.0, 5.0] if arch == "gemma2" else [None, None])


def test_gemma_configs_we_do_not_run_natively_go_to_transformers():
    from transformers import Gemma3TextConfig

    from apcscore.models.architecture import choose_model_backend, native_problem

    plain = Gemma3TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=128, vocab_size=100, architectures=["Gemma3ForCausalLM"])
    assert native_problem(plain) is None and choose_model_backend(plain) == "native"
    bidirectional = Gemma3TextConfig(**{**plain.to_dict(), "use_bidirectional_attention": True})
    assert "bidirectional" in native_problem(bidirectional)
    assert choose_model_backend(bidirectional) == "transformers"
    with pytest.raises(ApcscoreError, match="model-backend transformers"):
        choose_model_backend(bidirectional, "native")
