"""Write a tiny GGUF file from a tiny Hugging Face model directory, laid out as llama.cpp's convert_hf_to_gguf.py
lays out that family, for the tests of the GGUF path (tests/models/test_gguf_families.py). No model hub is reachable,
so the tests make their own GGUF files.

`write_gguf(model_dir, out)` reads config.json, model.safetensors and tokenizer.json and writes:

- metadata: `general.*`, the `<arch>.*` keys llama.cpp writes for the family (the ones transformers' GGUF loader
  reads among them: context/embedding/feed-forward lengths, block count, head counts, rope base and dimension
  count, RMS epsilon, vocab size, key/value length, sliding window, expert counts), and the tokenizer as
  `tokenizer.ggml.*` (a "gpt2" byte-level BPE: tokens in id order, token types (3 = control for special added
  tokens), merges, bos/eos/unk/pad ids, add_bos_token), like the default SmolLM2 GGUF;
- tensors under gguf-py's names (`gguf.get_tensor_name_map`), with the transforms llama.cpp applies (and
  transformers' loader undoes): Llama's q/k rows permuted for its interleaved rotary; Gemma's norm weights
  stored as `1 + w`; GPT-2's Conv1D weights transposed; per-expert MoE weights stacked into
  `ffn_{gate,up,down}_exps`; Qwen2-MoE's shared-expert gate as a vector; no `output.weight` when the embeddings
  are tied; a "llama3" rope as llama.cpp's `rope_freqs.weight` factors and a Phi-3 long-rope as
  `rope_factors_{long,short}.weight` (transformers' loader ignores both).

Tensors are float32, or float16 for 2-D ones with `f16=True` (norms and biases stay float32, as llama.cpp
keeps 1-D tensors). Not a general converter: only the families and checkpoint layouts of conftest's tiny models.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

# transformers model_type -> GGUF general.architecture (llama.cpp writes Mistral and Mixtral as "llama")
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen2_moe": "qwen2moe", "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3",
             "gpt_neox": "gptneox", "olmo2": "olmo2", "gpt2": "gpt2"}
_PERMUTED_QK = {"llama"}  # llama.cpp reorders q/k rows for these GGUF architectures
_NORM_PLUS_ONE = {"gemma2", "gemma3"}  # llama.cpp stores Gemma's RMSNorm weights as 1 + w
_TRANSPOSED = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")  # GPT-2 Conv1D
_EXPERT = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_GGUF = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotary pairs (i, i + d/2) of each head become adjacent rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(config: dict, head_dim: int) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` tensor for a "llama3" rope: each frequency's divisor (its generate_extra_tensors)."""
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") != "llama3":
        return None
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:  # Gemma 3: one entry per layer type; the file's base is the global one
        rope = rope["full_attention"]
    return float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)


def _add_hparams(w, arch: str, config: dict) -> None:
    """The `<arch>.*` keys llama.cpp writes for this family (and transformers reads)."""
    if arch == "gpt2":
        w.add_context_length(config["n_positions"])
        w.add_embedding_length(config["n_embd"])
        w.add_feed_forward_length(config.get("n_inner") or 4 * config["n_embd"])
        w.add_block_count(config["n_layer"])
        w.add_head_count(config["n_head"])
        w.add_layer_norm_eps(config["layer_norm_epsilon"])
        return
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config.get("num_key_value_heads") or heads)
    w.add_vocab_size(config["vocab_size"])
    if arch == "gptneox":
        rotary = (config.get("rope_parameters") or {}).get("partial_rotary_factor", config.get("rotary_pct", 1.0))
        w.add_rope_dimension_count(int(rotary * head_dim))
        w.add_layer_norm_eps(config["layer_norm_eps"])
        w.add_parallel_residual(bool(config.get("use_parallel_residual", True)))
    else:
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(_rope_theta(config))
    if config.get("head_dim") and config["head_dim"] != config["hidden_size"] // heads or arch.startswith("gemma"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch.startswith("gemma") and config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("num_local_experts") or config.get("num_experts"):
        w.add_expert_count(config.get("num_local_experts") or config["num_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "qwen2moe":
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _add_tokenizer(w, model_dir: Path) -> None:
    """The tokenizer.json's byte-level BPE as `tokenizer.ggml.*` keys (llama.cpp's "gpt2" tokenizer model)."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if tok["model"]["type"] != "BPE":
        raise ValueError(f"{model_dir}: only byte-level BPE tokenizers are written, not {tok['model']['type']}")
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    vocab.update({content: t["id"] for content, t in added.items()})
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    types = [(3 if added[t]["special"] else 4) if t in added else 1 for t in tokens]  # control / user / normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                     ("unk_token", w.add_unk_token_id), ("pad_token", w.add_pad_token_id)):
        if tok_config.get(key) in vocab:
            add(vocab[tok_config[key]])
    w.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))


def _gguf_tensors(state: dict[str, np.ndarray], model_type: str, arch: str, config: dict) -> dict[str, np.ndarray]:
    """Hugging Face tensors -> GGUF names and layouts (llama.cpp's transforms applied)."""
    import gguf

    name_map = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                        config.get("num_hidden_layers") or config["n_layer"])
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for hf_name, value in state.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings", True):
            continue
        if hf_name.endswith(_TRANSPOSED):
            value = value.T  # llama.cpp stores GPT-2's Conv1D weights as [out, in]
        if m := _EXPERT.fullmatch(hf_name):
            experts.setdefault((m[1], _EXPERT_GGUF[m[3]]), {})[int(m[2])] = value
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_base = name_map.get_name(base)
        if gguf_base is None:
            raise ValueError(f"no GGUF name for {hf_name} in gguf-py's {arch} tensor map")
        if arch in _PERMUTED_QK and gguf_base.endswith((".attn_q", ".attn_k")):
            heads = config["num_attention_heads"] if gguf_base.endswith("q") else config["num_key_value_heads"]
            value = _permute(value, heads)
        if arch in _NORM_PLUS_ONE and gguf_base.endswith("norm"):
            value = value + np.float32(1.0)
        if gguf_base.endswith("ffn_gate_inp_shexp"):
            value = value.reshape(-1)  # llama.cpp keeps the shared-expert gate as a vector
        out[f"{gguf_base}.{suffix}"] = value
    for (layer, kind), by_index in experts.items():
        block = name_map.get_name(f"{layer}.mlp.gate").rsplit(".", 1)[0]  # blk.N
        out[f"{block}.ffn_{kind}_exps.weight"] = np.stack([by_index[i] for i in sorted(by_index)])
    heads = config.get("num_attention_heads") or config["n_head"]
    rope_factors = _llama3_rope_factors(config, config.get("head_dim") or (config.get("hidden_size") or 0) // heads)
    if rope_factors is not None:
        out["rope_freqs.weight"] = rope_factors
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":  # Phi-3's long-rope factors, as llama.cpp's Phi3MiniModel writes them
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return out


def small_bpe_tokenizer(tokenizer, size: int = 1024):
    """The first `size` ids of a byte-level BPE fast tokenizer (e.g. the default SmolLM2 one) as a tokenizer of its
    own: those tokens, the merges among them, the same special tokens, pre-tokenizer and decoder.

    GGUF files keep the vocabulary and merges as metadata strings that gguf-py and transformers parse one by one
    (seconds for SmolLM2's 49152 + 48900); a small vocabulary keeps a tiny GGUF's load in milliseconds.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = {token: index for token, index in spec["model"]["vocab"].items() if index < size}
    pairs = [m.split(" ") if isinstance(m, str) else m for m in spec["model"]["merges"]]
    spec["model"]["vocab"] = vocab
    spec["model"]["merges"] = [[a, b] for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < size]
    specials = {key: getattr(tokenizer, key) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), **specials)


def write_gguf(model_dir: Path, out: Path, *, name: str = "tiny", f16: bool = False, quant: str | None = None) -> Path:
    """Write `model_dir` (config.json, model.safetensors, tokenizer.json) as the GGUF file `out`; return it.

    quant: a GGML block type gguf-py quantizes ("Q8_0", "Q5_1", "Q4_0", ...) for every 2-D tensor whose rows are
    whole blocks (as llama.cpp's quantize; the others stay float32)."""
    import gguf
    from safetensors.numpy import load_file

    model_dir, out = Path(model_dir), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    state = {k: v.astype(np.float32) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    tensors = _gguf_tensors(state, model_type, arch, config)

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    _add_hparams(w, arch, config)
    _add_tokenizer(w, model_dir)
    qtype = getattr(gguf.GGMLQuantizationType, quant) if quant else None
    for tensor_name, value in tensors.items():
        if qtype is not None and value.ndim == 2 and value.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            w.add_tensor(tensor_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(tensor_name, value.astype(np.float16) if f16 and value.ndim > 1 else value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
