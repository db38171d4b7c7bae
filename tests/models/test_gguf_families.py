"""GGUF files of the native families: where transformers' GGUF loader reads a family, the file loads, runs on our
native decoder and scores like transformers; where it does not, the user gets a clear error; where it reads the
file but leaves out a setting the file states, the user is warned.

Every GGUF here is written by the test itself (tests/gguf_files.py, llama.cpp's layout) from a tiny random model
of conftest's `build_tiny_model`, with a 1024-token cut of the default model's byte-level BPE tokenizer. The
REFERENCE is transformers loading that same GGUF (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`):
our prompt logprobs and top-3 must match its log-softmax within 1e-4 (fp32, CPU), and our tokenizer must give its
token ids. As a check on the test's own writer, the weights transformers reads back must equal the tiny model's
(within 1e-6: Gemma's norms are stored as 1 + w).

Some tiny configs are changed so that transformers' GGUF loader can read them back (`GGUF_OVERRIDES`): it does
not read Qwen3's head_dim (it takes the class default, 128) nor Qwen2-MoE's expert widths or dense layers (class
defaults 1408 / 5632, every layer sparse); test_unreadable_settings_give_a_clear_error shows the error otherwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from apcscore import EngineConfig, Request
from apcscore.engine import load_engine
from apcscore.errors import ApcscoreError
from apcscore.models.architecture import choose_model_backend, native_architecture
from apcscore.models.gguf_cache import CACHE_MARKER
from apcscore.models.loading import load_config
from apcscore.models.locate import resolve_model
from conftest import build_tiny_model
from gguf_files import small_bpe_tokenizer, write_gguf

# tiny arch -> the native architecture its GGUF must route to (llama.cpp writes Mistral as "llama")
SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
             "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
GGUF_OVERRIDES = {  # what transformers' GGUF loader takes from the class defaults instead of the file
    "qwen3": {"head_dim": 128},
    "qwen2_moe": {"mlp_only_layers": [], "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632},
}
# the settings each tiny GGUF states that transformers' reading leaves out: the user is warned of each
# (conftest's Gemma 2 soft-caps 5 / 10; transformers runs Gemma2Config's 50 / 30)
DROPPED = {"gemma2": ["gemma2.attn_logit_softcapping = 5.0: transformers runs attn_logit_softcapping = 50.0",
                      "gemma2.final_logit_softcapping = 10.0: transformers runs final_logit_softcapping = 30.0"],
           "llama3": ["rope_freqs.weight (per-frequency rope factors"],
           "phi3-longrope": ["rope_factors_long.weight / rope_factors_short.weight (Phi-3 long-rope)"]}
TOL = 1e-4
# "cafe\u0301" is not NFC-normalised: Qwen2Tokenizer's NFC (AutoTokenizer on the copy) would give other ids
TEXT = "The quick brown fox jumps over the lazy dog. GGUF files: 3 tensors, 2 layers, émigré, cafe\u0301!"


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    """The tiny models' tokenizer: the default model's first 1024 tokens and their merges (fast GGUF loads)."""
    return small_bpe_tokenizer(default_tokenizer, 1024)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Every test converts into its own empty apcscore cache."""
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))


def tiny_gguf(tmp_path: Path, tokenizer, arch: str, overrides: dict | None = None, f16: bool = False) -> Path:
    model_dir = build_tiny_model(arch, tmp_path / f"hf-{arch}", tokenizer, overrides)
    return write_gguf(model_dir, tmp_path / "gguf" / f"tiny-{arch}.gguf", f16=f16)


def reference(gguf: Path):
    """transformers' own reading of the GGUF: (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def assert_scores_match(gguf: Path, hf, hf_tokenizer, native: str | None, dropped: list[str] = ()) -> None:
    """Our engine on the GGUF: the `native` decoder (None: the transformers fallback), transformers' token ids,
    prompt logprobs and top-3 within TOL of transformers; a warning for each `dropped` setting, no other."""
    path, warnings = resolve_model(str(gguf))
    assert (path / CACHE_MARKER).is_file()  # the converted copy
    assert len(warnings) == len(dropped)
    for warning, setting in zip(warnings, dropped):
        assert warning.startswith(f"{gguf.name} states {setting}")
    config = load_config(path)
    assert native_architecture(config) == native
    assert choose_model_backend(config) == ("native" if native else "transformers")
    engine = load_engine(str(gguf), EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128,
                                                 block_size=4, max_batch_tokens=32))
    assert type(engine).__name__ == ("Engine" if native else "TransformersEngine")
    # the copy's tokenizer gives transformers' ids for the GGUF (Qwen2 and Gemma: not so when loaded as their class)
    assert engine.tokenizer.backend_tokenizer.to_str() == hf_tokenizer.backend_tokenizer.to_str()
    text_ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    assert text_ids == hf_tokenizer.encode(TEXT, add_special_tokens=False)
    g = torch.Generator().manual_seed(0)
    ps = [text_ids] + [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (2, 70)]
    outs = {o.request_id: o for o in engine.run(Request(i, p, prompt_logprobs=3) for i, p in enumerate(ps))}
    for i, p in enumerate(ps):
        assert outs[i].error is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)[:-1]
        ref_lp = ref.gather(1, torch.tensor(p[1:])[:, None])[:, 0].numpy()
        lps = outs[i].prompt_logprobs
        assert np.abs(lps.token_logprobs - ref_lp).max() < TOL, (native, len(p))
        assert np.abs(lps.top_logprobs - ref.topk(3, -1).values.numpy()).max() < TOL


def assert_weights_read_back(hf, model_dir: Path) -> None:
    """The test's writer: transformers reads back exactly the tiny model's weights (Gemma's 1 + w: within 1e-6)."""
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    read = hf.state_dict()
    assert set(read) == set(original)
    assert max((read[k] - original[k]).abs().max().item() for k in original) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(SUPPORTED))
def test_gguf_of_a_native_family_scores_like_transformers(arch, tmp_path, tokenizer):
    gguf = tiny_gguf(tmp_path, tokenizer, arch, GGUF_OVERRIDES.get(arch))
    hf, hf_tokenizer = reference(gguf)
    assert_weights_read_back(hf, tmp_path / f"hf-{arch}")
    assert_scores_match(gguf, hf, hf_tokenizer, SUPPORTED[arch], DROPPED.get(arch, []))


def test_llama3_rope_factors_are_dropped_by_transformers_and_we_warn(tmp_path, tokenizer):
    """llama.cpp keeps a "llama3" rope (Llama 3.1+) as rope_freqs.weight factors; transformers' loader ignores
    them and runs plain rope. We follow its reading (the reference) and warn."""
    gguf = tiny_gguf(tmp_path, tokenizer, "llama3")
    hf, hf_tokenizer = reference(gguf)
    assert dict(hf.config.rope_parameters).get("rope_type", "default") == "default"
    assert_weights_read_back(hf, tmp_path / "hf-llama3")
    assert_scores_match(gguf, hf, hf_tokenizer, "LlamaForCausalLM", DROPPED["llama3"])


def test_gguf_of_a_family_we_do_not_run_natively_runs_on_the_fallback(tmp_path, tokenizer):
    """GPT-2 (GGUF "gpt2"; transformers reads its context length as n_ctx, so wpe must have 1024 rows)."""
    gguf = tiny_gguf(tmp_path, tokenizer, "gpt2", {"n_positions": 1024})
    hf, hf_tokenizer = reference(gguf)
    assert_weights_read_back(hf, tmp_path / "hf-gpt2")
    assert_scores_match(gguf, hf, hf_tokenizer, None)


def test_f16_gguf_scores_like_transformers(tmp_path, tokenizer):
    """2-D tensors stored as float16 (as llama.cpp's --outtype f16): both sides widen them to the same fp32."""
    gguf = tiny_gguf(tmp_path, tokenizer, "qwen3", GGUF_OVERRIDES["qwen3"], f16=True)
    hf, hf_tokenizer = reference(gguf)
    assert_scores_match(gguf, hf, hf_tokenizer, "Qwen3ForCausalLM")


@pytest.mark.parametrize("arch", ["neox", "olmo2"])
def test_families_transformers_cannot_read_from_gguf_give_a_clear_error(arch, tmp_path, tokenizer):
    """GPT-NeoX ("gptneox") and OLMo 2 ("olmo2") GGUFs: transformers has no GGUF reader; their HF directories
    run natively."""
    gguf = tiny_gguf(tmp_path, tokenizer, arch)
    with pytest.raises(ApcscoreError) as err:
        resolve_model(str(gguf))
    msg = str(err.value)
    assert f"Could not load the GGUF file {gguf}" in msg and "not supported" in msg
    assert "qwen2" in msg and "original Hugging Face model directory" in msg
    assert not list((tmp_path / "cache" / "models").glob("tiny-*"))  # nothing cached


def test_mixtral_gguf_is_refused_not_loaded_with_random_experts(tmp_path, tokenizer):
    """llama.cpp writes Mixtral as "llama" with stacked expert tensors; transformers reads that as a dense Llama
    and fills its MLPs with random values (a warning only). We refuse to cache or run such a model."""
    gguf = tiny_gguf(tmp_path, tokenizer, "mixtral")
    with pytest.raises(ApcscoreError) as err:
        resolve_model(str(gguf))
    msg = str(err.value)
    assert "LlamaForCausalLM" in msg and "mlp.down_proj.weight" in msg and "Mixtral" in msg
    assert not list((tmp_path / "cache" / "models").glob("tiny-*"))


def test_unreadable_settings_give_a_clear_error(tmp_path, tokenizer):
    """conftest's Qwen3 (head_dim 32): the file states attention.key_length = 32, transformers ignores it and
    builds head_dim 128 weights, then refuses the mismatched shapes; we pass that on as our error."""
    gguf = tiny_gguf(tmp_path, tokenizer, "qwen3")
    with pytest.raises(ApcscoreError) as err:
        resolve_model(str(gguf))
    assert f"Could not load the GGUF file {gguf}" in str(err.value) and "mismatch" in str(err.value)


def test_phi3_long_rope_factors_are_dropped_by_transformers_and_we_warn(tmp_path, tokenizer):
    """A long-rope Phi-3 (128k) runs on our fallback from its HF directory (tests/engine/test_transformers_fallback.py);
    its GGUF keeps the factors as rope_factors_{long,short}.weight, which transformers ignores: plain rope, so
    the model transformers reads is one our native decoder runs. We follow that reading and warn."""
    half = 8  # head_dim 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "original_max_position_embeddings": 512, "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)]}
    gguf = tiny_gguf(tmp_path, tokenizer, "phi3", {"rope_parameters": rope})
    hf, hf_tokenizer = reference(gguf)
    assert dict(hf.config.rope_parameters).get("rope_type", "default") == "default"
    assert_weights_read_back(hf, tmp_path / "hf-phi3")
    assert_scores_match(gguf, hf, hf_tokenizer, "Phi3ForCausalLM", DROPPED["phi3-longrope"])


def test_cli_warns_of_each_dropped_setting_on_every_run(tmp_path, tokenizer, write_jsonl):
    """score on a Gemma 2 GGUF: none with --quiet (the run that converts), and one warning line per soft-cap
    transformers replaces on a later run, from the cache."""
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from apcscore.cli import app

    gguf = tiny_gguf(tmp_path, tokenizer, "gemma2")
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": TEXT}, {"id": "b", "prompt": "x y z"}])
    for run, quiet in enumerate((True, False)):
        args = ["score", str(data), "--model", str(gguf), "--out", str(tmp_path / f"o{run}.parquet")]
        res = CliRunner().invoke(app, args + (["--quiet"] if quiet else []), env={"COLUMNS": "300"})
        assert res.exit_code == 0, res.output
        text = " ".join(res.output.split())
        for setting in DROPPED["gemma2"]:
            assert (f"warning: {gguf.name} states {setting}" in text) != quiet, res.output
        assert pq.read_table(tmp_path / f"o{run}.parquet").num_rows == 2
