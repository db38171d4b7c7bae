"""Incremental detokenization for stop strings (issue 15, item 3): the text built token by token equals a full
decode at every step (up to a character not yet complete), on tricky tokenizations: byte-level BPE tokens that
split UTF-8 characters, emoji with modifiers, CJK, special tokens, spaces before punctuation, random ids; and a
SentencePiece-style tokenizer (Llama's decoder strips the first leading space). Decoding stays O(n)."""

from __future__ import annotations

import random

import pytest

from apcscore.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer, find_stop

TEXTS = [
    "Hello, world! Don't stop . . . now ?",
    "naïve café — 日本語のテキスト、中文也可以。 한국어",
    "emoji 👍🏽👨‍👩‍👧 flags 🇫🇷 and math ∑∫√",
    "  leading spaces\n\n\ttabs and\r\nnewlines   ",
    "code: def f(x):\n    return x**2  # comment",
]


def check_incremental(tok, ids: list[int], prompt: list[int] | None = None) -> IncrementalDetokenizer:
    prompt = prompt or []
    detok = IncrementalDetokenizer(tok)
    for n in range(1, len(ids) + 1):
        tokens = prompt + ids[:n]
        detok.update(tokens, start=len(prompt))
        full = tok.decode(ids[:n], skip_special_tokens=True)
        if full.endswith(REPLACEMENT):  # a character not complete yet: its complete part only
            assert full.startswith(detok.text) and REPLACEMENT not in full[len(detok.text):].rstrip(REPLACEMENT)
            assert detok.text == full.rstrip(REPLACEMENT)
        else:
            assert detok.text == full, (n, detok.text, full)
    return detok


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_equals_full_decode(default_tokenizer, text: str) -> None:
    ids = default_tokenizer(text, add_special_tokens=False).input_ids
    check_incremental(default_tokenizer, ids, prompt=[1, 2, 3])


def test_special_tokens_and_split_characters(default_tokenizer) -> None:
    tok = default_tokenizer
    special = tok.convert_tokens_to_ids("<|im_end|>")
    emoji = tok("👍🏽", add_special_tokens=False).input_ids
    assert len(emoji) > 1 and any(REPLACEMENT in tok.decode([i]) for i in emoji)  # tokens split its bytes
    ids = tok("Hi", add_special_tokens=False).input_ids + [special] + emoji + [special] + tok(" there .").input_ids
    detok = check_incremental(tok, ids)
    assert detok.text == "Hi👍🏽 there ."


def test_random_ids_equal_full_decode(default_tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(default_tokenizer)) for _ in range(40)]
        check_incremental(default_tokenizer, ids)


def sentencepiece_like():
    """A Llama-style tokenizer: Metaspace pieces with byte fallback; the decoder strips the first space."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "!", "▁", "ing", "▁sing", ".", "▁.", "▁é"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    vocab = {p: i for i, p in enumerate(pieces)}
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    tk = Tokenizer(model)
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return fast, vocab


def test_sentencepiece_leading_space_and_byte_fallback() -> None:
    tok, v = sentencepiece_like()
    assert tok.decode([v["▁world"]]) == "world" and tok.decode([v["▁Hello"], v["▁world"]]) == "Hello world"
    e_acute = [v["<0xC3>"], v["<0xA9>"]]  # é as two byte tokens
    smile = [v[f"<0x{b:02X}>"] for b in "😀".encode()]
    ids = [v["▁Hello"], v["▁world"], v["!"], v["▁"], *e_acute, v["▁sing"], v["ing"], v["▁."], v["</s>"], *smile,
           v["▁world"], v["▁é"], v["."]]
    detok = check_incremental(tok, ids, prompt=[v["<s>"], v["▁Hello"]])
    assert detok.text == tok.decode(ids, skip_special_tokens=True)


def test_decoding_is_linear(default_tokenizer) -> None:
    """Every step decodes a short window, not the whole completion."""
    decoded = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return default_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = default_tokenizer(" ".join(TEXTS) * 4, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(Counting())
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n])
    assert detok.text == default_tokenizer.decode(ids)
    assert len(ids) > 300 and max(decoded) <= 8 and sum(decoded) <= 6 * len(ids)


def test_find_stop_only_looks_at_new_matches() -> None:
    assert find_stop("abc STOP def", ["STOP"], 0) == 4
    assert find_stop("abc STO", ["STOP"], 5) is None
    assert find_stop("abc STOP", ["STOP"], 7) == 4  # the match ends in the new text
    assert find_stop("xx ab yy", ["yy", "ab"], 4) == 3  # the earliest start wins


@pytest.mark.slow
def test_engine_stops_where_a_full_decode_would(tiny_model_dir, default_tokenizer) -> None:
    """The engine's stop strings, found in the incremental text: the completion ends at the first token whose
    full decode contains a stop string, and the text is cut before it (as with a full decode every step)."""
    from apcscore import EngineConfig, Request, SamplingParams
    from apcscore.engine.loader import load_native_engine

    engine = load_native_engine(str(tiny_model_dir("llama")), EngineConfig(device="cpu", num_kv_blocks=128,
                                                                           block_size=4))
    prompt = default_tokenizer("Once upon a time", add_special_tokens=False).input_ids
    (free,) = engine.run([Request(0, prompt, sampling=SamplingParams(max_tokens=24, ignore_eos=True))])
    ids = free.output_token_ids
    text = default_tokenizer.decode(ids, skip_special_tokens=True)
    checked = 0
    for start in range(1, len(text) - 3, max(1, (len(text) - 4) // 6)):
        stop = text[start:start + 3]
        cut = text.find(stop)
        # the first token count whose decode holds the stop string
        n = next(n for n in range(1, len(ids) + 1)
                 if stop in default_tokenizer.decode(ids[:n], skip_special_tokens=True))
        (out,) = engine.run([Request(0, prompt, sampling=SamplingParams(max_tokens=24, ignore_eos=True,
                                                                        stop=(stop, "\x00never")))])
        assert out.finish_reason == "stop" and out.output_text == text[:cut], stop
        assert out.output_token_ids == ids[:n]
        checked += 1
    assert checked >= 5
