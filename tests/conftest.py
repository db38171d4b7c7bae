"""Shared pytest fixtures for the whole apcscore suite.

Model fixtures (all session scoped, built once per test run):

- `default_model_dir`: the Hugging Face folder of the default model "smollm2-135m" (SmolLM2-135M-Instruct). Its GGUF
  is converted once *per machine* into the persistent cache ($APCSCORE_CACHE, default ~/.cache/apcscore):
  ~25 s the first time, milliseconds afterwards.
- `default_tokenizer`: its tokenizer (bos <|im_start|> id 1, eos <|im_end|> id 2, no BOS added on encode).
- `hf_default_model`: the transformers `AutoModelForCausalLM` of the default model, fp32, eval mode: the
  reference our own decoder is checked against.
- `tiny_model_dir(arch)`: a small random-weight Hugging Face model directory (config.json, model.safetensors,
  the default model's tokenizer) for arch in `TINY_ARCHS`. Shared by every test: copy it
  (`shutil.copytree`) before changing anything in it.
- `tiny`: the path (a str, as the CLI takes it) of the tiny llama directory, the model of most CLI tests.

Data helpers:

- `write_jsonl(path, records)`: write a JSONL file (dicts as JSON; str items written verbatim, for
  malformed-line tests) and return its path.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

# The converted default model lives in a persistent cache, so CI converts the GGUF once per machine,
# not once per test or per run. Set before anything resolves a model; a value from the caller wins.
os.environ.setdefault("APCSCORE_CACHE", str(Path.home() / ".cache" / "apcscore"))
# lm-eval bootstraps some metrics' stderr (perplexity, f1, ...) in a fork-started multiprocessing pool: a fork of
# this test process (GBs, torch's threads) per CPU and metric. One such worker hung a CI run at the pool's exit.
# Serially it draws the same resamples with the same seeds (`_bootstrap_internal_no_mp`): the same numbers.
# (tests/lmeval/test_lmeval_signals.py checks what apcscore eval does about forks, with a pool of its own.)
os.environ.setdefault("DISABLE_MULTIPROC", "1")

DEFAULT_MODEL = "smollm2-135m"


def _row_exact_interpreter_dot() -> None:
    """Make the Triton interpreter's `tl.dot` give each output row bits that do not depend on the row's
    position inside the tile, as a GPU's tensor-core MMA does.

    The interpreter computes `tl.dot` with `np.matmul`, i.e. OpenBLAS, whose kernels (chosen per CPU at run
    time: DYNAMIC_ARCH) may round a row differently depending on where it sits in the matrix. Measured on
    numpy 2.4 / OpenBLAS 0.3.31 on an AMD EPYC: 11 of 15 row shifts of a [16, 64] @ [64, 32] product change
    bits. Our kernels' invariance tests (fixed key tiles, fixed query blocking) would then test OpenBLAS, not
    our blocking. `np.einsum(..., optimize=False)` sums each output element over k in one fixed order.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype, optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


_row_exact_interpreter_dot()

# Architectures `tiny_model_dir` builds. "gpt2" and "falcon" are not implemented by our decoder: they run
# through the transformers fallback (apcscore.engine.hf_engine; tests/engine/test_transformers_fallback.py).
TINY_ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "neox", "olmo2", "phi3", "phi3_longrope",
              "phi3_partial", "mixtral", "qwen2_moe", "gemma2", "gemma3", "gpt2", "falcon")

# Shared shape of the tiny models: hidden 64, 2 layers, 4 query heads, 2 kv heads (GQA), context 2048.
_TINY_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=2048,
    initializer_range=0.2,  # large enough that logits are far from uniform
)

# Llama-3.2's rope_type "llama3" with a short original context (Llama-3.2 itself: factor 32,
# original 8192), so that with head_dim 16 the three frequency bands (kept, smoothed, divided by
# `factor`) are all present and matter at the short positions tests use.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _tiny_config(arch: str, vocab_size: int, bos: int, eos: int):
    """The small transformers config of `arch` (see TINY_ARCHS)."""
    from transformers import (FalconConfig, Gemma2Config, Gemma3TextConfig, GPT2Config, GPTNeoXConfig, LlamaConfig,
                              MistralConfig, MixtralConfig, Olmo2Config, Phi3Config, Qwen2Config, Qwen2MoeConfig,
                              Qwen3Config)

    ids = dict(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos)
    if arch == "llama":
        return LlamaConfig(**_TINY_COMMON, **ids, tie_word_embeddings=False)
    if arch == "llama3":
        return LlamaConfig(**_TINY_COMMON, **ids, tie_word_embeddings=False, rope_parameters=dict(_LLAMA3_ROPE))
    if arch == "mistral":
        # No sliding window: with it, attention would differ from plain causal attention past 4096 tokens only.
        return MistralConfig(**_TINY_COMMON, **ids, tie_word_embeddings=False, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**_TINY_COMMON, **ids, tie_word_embeddings=False)  # q/k/v projections have bias
    if arch == "qwen3":
        # q/k RMSNorm; head_dim 32 != hidden 64 / 4 heads; tied embeddings.
        return Qwen3Config(**_TINY_COMMON, **ids, head_dim=32, tie_word_embeddings=True)
    if arch == "neox":  # Pythia's shape: rotary on a quarter of each head, parallel residual, LayerNorm + bias
        return GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                             max_position_embeddings=2048, initializer_range=0.2, rotary_pct=0.25,
                             use_parallel_residual=True, tie_word_embeddings=False, **ids)
    if arch == "olmo2":  # post-norms, q/k RMSNorm over the whole projection
        return Olmo2Config(**_TINY_COMMON, **ids, tie_word_embeddings=False)
    if arch == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint; default rope (no long-rope)
        return Phi3Config(**_TINY_COMMON, **ids, tie_word_embeddings=False, sliding_window=None, pad_token_id=0)
    if arch in ("phi3_longrope", "phi3_partial"):
        # Phi-3-mini-128k / Phi-3.5-mini's long-rope with original context 32 (real: 4096) and context 256, so that
        # prompts and generations cross it; distinct short and long factors per frequency. "phi3_partial" adds
        # Phi-4-mini's partial rotary (half of each head here; real: 0.75) and tied embeddings.
        partial = arch == "phi3_partial"
        half = (8 if partial else 16) // 2  # rotary dimensions / 2 (head_dim 16)
        rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5 if partial else 1.0,
                    short_factor=[1.0 + 0.05 * i for i in range(half)],
                    long_factor=[1.5 + 0.75 * i for i in range(half)])
        common = {**_TINY_COMMON, "max_position_embeddings": 256}
        return Phi3Config(**common, **ids, tie_word_embeddings=partial, sliding_window=None, pad_token_id=0,
                          original_max_position_embeddings=32, rope_parameters=rope)
    if arch == "mixtral":  # 4 experts, top-2, weights renormalised
        return MixtralConfig(**_TINY_COMMON, **ids, num_local_experts=4, num_experts_per_tok=2,
                             tie_word_embeddings=False, sliding_window=None)
    if arch == "qwen2_moe":  # layer 0 sparse (4 experts, top-2, not renormalised, a gated shared expert), 1 dense
        return Qwen2MoeConfig(**_TINY_COMMON, **ids, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                              shared_expert_intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1],
                              tie_word_embeddings=False)
    # Gemma: head_dim 16 with query_pre_attn_scalar 24 (not head_dim), layer 0 sliding and layer 1 global; the
    # windows (24: inside one key tile; 70: across a tile boundary) are far below the prompts tests use
    if arch == "gemma2":  # attention and final logit soft-capping at values small enough to matter
        return Gemma2Config(**_TINY_COMMON, **ids, head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
                            attn_logit_softcapping=5.0, final_logit_softcapping=10.0, pad_token_id=0)
    if arch == "gemma3":  # q/k norms, local rope base 10k vs global 1M, final soft-capping
        return Gemma3TextConfig(**_TINY_COMMON, **ids, head_dim=16, query_pre_attn_scalar=24, sliding_window=70,
                                layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=10.0,
                                pad_token_id=0)
    if arch == "gpt2":
        return GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=2048, initializer_range=0.2, **ids
        )
    if arch == "falcon":  # multi-query attention, parallel attention + MLP, rotary, LayerNorm with bias
        return FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2048,
                            initializer_range=0.2, bias=True, **ids)
    raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")


def build_tiny_model(arch: str, out_dir: Path, tokenizer, overrides: dict[str, Any] | None = None) -> Path:
    """Save a deterministic random-weight model of `arch` plus `tokenizer` into `out_dir`; return it.

    `overrides` sets config attributes after the tiny config is made (e.g. {"head_dim": 128}).

    Weights come from the config's initializer under torch.manual_seed(0); then norm weights are drawn
    around 1 and biases around 0 (they initialize to exactly 1 and 0, which would hide a decoder that
    ignores them).
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = _tiny_config(arch, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif param.ndim == 1:  # the only 1-D weights in these architectures are norm scales
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def default_model_dir():
    """The folder of "smollm2-135m", converted into the persistent cache on first use."""
    from apcscore.models.locate import resolve_model

    path, _ = resolve_model(DEFAULT_MODEL)
    return path


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    """The default model's tokenizer, loaded from its cached Hugging Face copy."""
    from apcscore.models.loading import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def hf_default_model(default_model_dir):
    """transformers' AutoModelForCausalLM of the default model: fp32, eval mode, on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer) -> Callable[[str], Path]:
    """Factory: `tiny_model_dir(arch)` -> a tiny random-weight HF model directory, built once per arch.

    arch is one of TINY_ARCHS. Every model: hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 128,
    vocab 49152 (the default tokenizer's), max_position_embeddings 2048, fp32 safetensors.
    The directory is shared: copy it before modifying it.
    """
    built: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in TINY_ARCHS:
            raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")
        if arch not in built:
            built[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), default_tokenizer)
        return built[arch]

    return make


@pytest.fixture(scope="session")
def tiny(tiny_model_dir) -> str:
    """The tiny llama model directory's path, as `--model` takes it (shared: copy it before changing it)."""
    return str(tiny_model_dir("llama"))


def _write_jsonl(path: Path, records: Iterable[dict[str, Any] | str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            line = record if isinstance(record, str) else json.dumps(record, ensure_ascii=False)
            f.write(line.rstrip("\n") + "\n")
    return path


@pytest.fixture
def write_jsonl() -> Callable[[Path, Iterable[dict[str, Any] | str]], Path]:
    """`write_jsonl(path, records)` -> path: one JSON object per line; a str record is written verbatim."""
    return _write_jsonl


@pytest.fixture
def matmul_launches(monkeypatch) -> list:
    """The configuration (a MatmulConfig) of every plain Triton matmul launch made in the test, in order:
    kernels/matmul.py's `_linear_kernel[grid](...)` is watched, and still runs."""
    from apcscore.kernels import matmul, matmul_configs

    launched: list = []
    kernel = matmul._linear_kernel

    class WatchedKernel:  # kernel[grid](...) as Triton's launcher, recording the launch configuration
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append(matmul_configs.MatmulConfig(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"],
                                                            kw["GROUP_M"], kw["num_warps"], kw["num_stages"]))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(matmul, "_linear_kernel", WatchedKernel())
    return launched


@pytest.fixture(scope="module")
def in_repo() -> Any:
    """The working directory at the repository root for a module: lm-eval task YAMLs
    (tests/lmeval_tasks/) name their data files relative to it."""
    before = os.getcwd()
    root = Path(__file__).resolve().parent.parent
    os.chdir(root)
    yield root
    os.chdir(before)


# --- live timing: CI prints only dots under -q, and a run stopped at its time limit prints no --durations.
# Each test phase slower than APCSCORE_SLOW_TEST_S (default 30 s) is reported as it finishes, with the time
# since the session began, so the log of a stopped run still says where the time went.
_live: dict[str, Any] = {}


def pytest_configure(config) -> None:
    import time

    _live.update(start=time.monotonic(), config=config,
                 limit=float(os.environ.get("APCSCORE_SLOW_TEST_S", "30")))


def pytest_sessionstart(session) -> None:
    """One line of machine facts, even under -q: a slow CI run can then be told from a slow machine."""
    import platform

    import torch

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    reporter.write_line(f"[machine] {cpu}; {usable} usable CPUs of {os.cpu_count()}; torch "
                        f"{torch.__version__}, {torch.get_num_threads()} threads, "
                        f"{torch.backends.cpu.get_cpu_capability()}")


def pytest_runtest_logreport(report) -> None:
    import time

    if "config" not in _live or report.duration < _live["limit"]:
        return
    reporter = _live["config"].pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        elapsed = time.monotonic() - _live["start"]
        reporter.write("\n")
        unmarked = "" if "slow" in report.keywords else " (not marked slow: make test-fast runs it)"
        reporter.write_line(f"[slow: {report.when} {report.duration:.0f} s, {elapsed:.0f} s into the run] "
                            f"{report.nodeid}{unmarked}")


@pytest.fixture(autouse=True)
def _no_log_handlers_on_closed_streams():
    """After each test, drop logging handlers whose stream is closed. A CLI run inside typer's CliRunner that sets
    up logging (lm-eval adds a StreamHandler on the sys.stdout of the moment) leaves a handler on the runner's
    captured stream, closed when the invocation ends; every later log record in the session then prints a
    '--- Logging error --- ... Traceback' report into the next test's output (seen in the full suite: a later
    eval test's output held 14 of them). A user's process has no such closed stream."""
    yield
    for logger in [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]:
        for handler in list(getattr(logger, "handlers", [])):
            if getattr(getattr(handler, "stream", None), "closed", False):
                logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def _not_in_github_actions(monkeypatch):
    """Tests run as on a developer's machine even inside GitHub Actions: `apcscore compare` prints workflow
    commands when GITHUB_ACTIONS is "true" and appends to the file GITHUB_STEP_SUMMARY names (the CI job's real
    summary). Tests of those outputs set both themselves."""
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
