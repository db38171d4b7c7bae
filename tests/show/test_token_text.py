"""Token texts (issue 52, item 7): byte-level BPE pieces merged into spans of whole UTF-8 characters, so that
accented Latin, CJK, Devanagari and emoji read as text in `apcscore show` and the HTML report, not as `�`
(`hlavní m��sto` before); a token that is part of a character, alone (a top-K alternative), shows its bytes as
<0xE8> (five different partial alternatives read as five different texts, not five `�`).

Three tokenizers: the default model's (byte-level BPE, the `default_tokenizer` fixture: its cached copy), a tiny
byte-level BPE trained here with the `tokenizers` library on ASCII only (every non-ASCII character splits into
byte tokens), and a tiny SentencePiece-style BPE with byte fallback (`<0xE8>` tokens)."""

from __future__ import annotations

import html
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.io.token_text import byte_decoder, id_texts, piece, spans, token_bytes, token_texts

TEXT = "Praha je hlavní město. 北京是中国的首都。 नमस्ते दुनिया 😀"


def _check(tt, ids, text: str) -> None:
    """Spans cover the tokens in order, read as the text, and none holds U+FFFD."""
    assert [s[0] for s in tt.spans] == [0, *(s[1] for s in tt.spans[:-1])] and tt.spans[-1][1] == len(ids)
    assert "".join(s[2] for s in tt.spans) == text
    assert not any("\ufffd" in s[2] or "\ufffd" in p for s in tt.spans for p in tt.pieces)


def test_the_default_tokenizer_splits_characters_and_the_spans_join_them(default_tokenizer) -> None:
    ids = default_tokenizer.encode(TEXT)
    tt = token_texts(default_tokenizer, ids)
    _check(tt, ids, TEXT)
    split = [s for s in tt.spans if s[1] - s[0] > 1]
    assert {s[2].strip() for s in split} >= {"ě", "北", "京", "首", "न", "😀"}  # characters split across tokens
    e = next(s for s in split if s[2] == "ě")
    assert tt.pieces[e[0]:e[1]] == ["<0xC4>", "<0x9B>"]  # each part alone: its bytes
    assert tt.span_of(e[0] + 1) == e
    # the old per-token decode read this record as `hlavní m��sto`
    assert [default_tokenizer.decode([i]) for i in ids[e[0]:e[1]]] == ["\ufffd", "\ufffd"]
    # special tokens keep their text (they are not in the byte alphabet's vocabulary strings)
    tt = token_texts(default_tokenizer, [1, *ids[:3], 2])
    assert tt.pieces[0] == "<|im_start|>" and tt.pieces[-1] == "<|im_end|>"


def test_partial_alternatives_alone_show_their_bytes(default_tokenizer) -> None:
    """Five top-K alternatives that are partial pieces (a CJK character's first bytes, a continuation byte) are
    five different texts."""
    ids = default_tokenizer.encode(" 北京 ě")
    alone = [token_texts(default_tokenizer, [i]).pieces[0] for i in ids]
    assert len(set(alone)) == len(alone) and all(re.search(r"<0x[0-9A-F]{2}>", a) for a in alone if a != " ")
    assert alone[0] == " <0xE5>"  # `Ġå`: a space, then the first byte of 北


def test_the_byte_table_is_transformers_bytes_to_unicode() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_decoder() == {c: b for b, c in bytes_to_unicode().items()}


def test_spans_of_bytes() -> None:
    assert spans([b"a", b"\xc4", b"\x9b", b"b"]) == [(0, 1, "a"), (1, 3, "ě"), (3, 4, "b")]
    assert spans([b"\xe5\x8c", b"\x97\xe4", b"\xba\xac"]) == [(0, 3, "北京")]  # pieces that straddle characters
    assert spans([b"\x9b", b"a"]) == [(0, 1, "<0x9B>"), (1, 2, "a")]  # a stray continuation byte: shown as bytes
    assert spans([b"a", b"\xc4"]) == [(0, 1, "a"), (1, 2, "<0xC4>")]  # cut at the end (a window's edge)
    assert piece(b" \xe5") == " <0xE5>" and piece("é".encode()) == "é"
    assert id_texts([5, 7]).spans == [(0, 1, "⟨5⟩"), (1, 2, "⟨7⟩")]


def _tiny_byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>"])
    tok.train_from_iterator(["the city is the capital of the country"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _tiny_sentencepiece():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for word in ("▁the", "▁city", "P", "r", "a", "h", "j", "e", "l", "v", "n", "m", "s", "t", "o", "."):
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("make", [_tiny_byte_level, _tiny_sentencepiece])
def test_tiny_tokenizers_built_here(make) -> None:
    tok = make()
    ids = tok.encode(TEXT, add_special_tokens=False)
    raw = token_bytes(tok, ids)
    assert raw is not None and b"".join(raw).decode().strip() == TEXT
    tt = token_texts(tok, ids)
    joined = "".join(s[2] for s in tt.spans)
    assert joined.strip() == TEXT and "\ufffd" not in joined
    assert any(s[1] - s[0] >= 3 and s[2].strip() == "北" for s in tt.spans)  # three byte tokens, one character
    # trained without them, every byte of a non-ASCII character is a token of its own, shown alone as <0x..>
    assert sum(p.count("<0x") for p in tt.pieces) == sum(len(c.encode()) for c in TEXT if ord(c) > 127)


def test_a_tokenizer_whose_vocabulary_is_not_bytes_decodes_per_token() -> None:
    class Words:  # a word-level tokenizer: its vocabulary strings are not bytes of the text
        words = ["<w0>", "hello", "world"]

        def convert_ids_to_tokens(self, ids):
            return [f"#{self.words[i]}#" for i in ids]

        def decode(self, ids, skip_special_tokens=False, **kw):
            return " ".join(self.words[i] for i in ids)

    tt = token_texts(Words(), [1, 2])
    assert token_bytes(Words(), [1, 2]) is None
    assert tt.pieces == ["hello", " world"] and tt.spans == [(0, 1, "hello"), (1, 2, " world")]


# ---------------------------------------------------------------------------------------------------------
# apcscore show and the HTML report on a record of split characters
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split_record(default_tokenizer, default_model_dir, tmp_path_factory):
    """A score file of one record, TEXT, tokenized by the default tokenizer, with made-up logprobs: every token
    -1.5, except the second byte of `ě` (-7.25); the top-5 at that position are five partial pieces."""
    ids = default_tokenizer.encode(TEXT)
    tt = token_texts(default_tokenizer, ids)
    e = next(s for s in tt.spans if s[2] == "ě")
    partial = default_tokenizer.encode(" 北京 ě")
    lps = [None] + [-1.5] * (len(ids) - 1)
    lps[e[0] + 1] = -7.25
    top_ids = [None] + [partial[:5]] * (len(ids) - 1)
    top_lps = [None] + [[-0.5, -1.0, -1.5, -2.0, -2.5]] * (len(ids) - 1)
    meta = {"apcscore_version": "0.1.0", "command": "score", "dtype": "float32",
            "model": {"name": "smollm2-135m", "path": str(default_model_dir), "vocab_size": 49152},
            "tokenizer": {"name_or_path": str(default_model_dir)},
            "dataset": {"path": "d.jsonl", "sha256": "ab" * 32}}
    schema = pa.schema([("id", pa.string()), ("status", pa.string()), ("error", pa.string()),
                        ("num_tokens", pa.int64()), ("num_scored", pa.int64()), ("sum_logprob", pa.float64()),
                        ("mean_nll", pa.float64()), ("perplexity", pa.float64()),
                        ("token_ids", pa.list_(pa.int64())), ("token_logprobs", pa.list_(pa.float32())),
                        ("token_ranks", pa.list_(pa.int64())), ("top_ids", pa.list_(pa.list_(pa.int64()))),
                        ("top_logprobs", pa.list_(pa.list_(pa.float32())))], metadata={"apcscore": json.dumps(meta)})
    s = sum(lp for lp in lps if lp is not None)
    rows = [{"id": "praha", "status": "ok", "num_tokens": len(ids), "num_scored": len(ids) - 1, "sum_logprob": s,
             "mean_nll": -s / (len(ids) - 1), "perplexity": 2.0, "token_ids": ids, "token_logprobs": lps,
             "token_ranks": [None] + [1] * (len(ids) - 1), "top_ids": top_ids, "top_logprobs": top_lps}]
    path = tmp_path_factory.mktemp("split") / "praha.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path, ids, e, partial


def test_show_prints_the_characters_and_names_a_partial_token(split_record) -> None:
    from apcscore.cli import app

    path, ids, e, partial = split_record
    r = CliRunner().invoke(app, ["show", str(path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "hlavní město." in r.stdout and "北京是中国的首都。 नमस्ते दुनिया 😀" in r.stdout
    assert "\ufffd" not in r.stdout
    # the least likely token is the second byte of ě, named with its character
    assert re.search(rf'│ {e[0] + 1} +│ "<0x9B>" \(part of "ě"\) +│ {ids[e[0] + 1]} +│ -7.2500 ', r.stdout)
    r = CliRunner().invoke(app, ["show", str(path), "--position", str(e[0] + 1)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert f'position {e[0] + 1}: "<0x9B>" (part of "ě") (id {ids[e[0] + 1]})' in r.stdout
    shown = re.findall(r'│ [1-5] +│ (".*?") +│', r.stdout)
    assert shown == ['" <0xE5>"', '"<0x8C>"', '"<0x97>"', '"<0xE4><0xBA>"', '"<0xAC>"']  # five different texts


def test_the_html_report_shows_the_characters(split_record, tmp_path) -> None:
    from apcscore.compare.gate import compare_files
    from apcscore.compare.html_report import to_html
    from apcscore.io.token_text import texts_for
    from apcscore.models.loading import load_tokenizer

    path, ids, e, _ = split_record
    c = compare_files(path, path)
    page = to_html(c, 1, texts_for(load_tokenizer(c.base.tokenizer)))
    view = page[page.index('<div class="record" data-id="praha">'):]
    view = view[:view.index("</div></div>")]
    texts = re.findall(r'<span class="tok[^"]*"(?: style="[^"]*")? title="([^"]*)">([^<]*)</span>', view)
    assert "".join(html.unescape(t) for _, t in texts).replace("↵\n", "\n") == TEXT
    title = html.unescape(next(t for t, text in texts if text == "ě"))
    assert title.startswith('"ě": 2 tokens (one character\'s bytes)')
    assert f'position {e[0]}: "<0xC4>"' in title and f'position {e[0] + 1}: "<0x9B>"' in title
    assert '"<0xE4><0xBA>"' in title  # a top-K alternative, alone
    assert "\ufffd" not in view
