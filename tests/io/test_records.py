"""Dataset loading and validation: kinds, every problem with its line, skip-invalid, limit, datasets as reference."""

from __future__ import annotations

import hashlib
import json
import re
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apcscore.errors import ApcscoreError
from apcscore.io.reader import MAX_LISTED_PROBLEMS, load_dataset


def write(tmp_path: Path, lines: list[str] | bytes, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(lines if isinstance(lines, bytes) else ("\n".join(lines) + "\n").encode())
    return path


def problems_of(path: Path, command: str, **kw) -> list[str]:
    """The problem lines of the ApcscoreError that loading raises."""
    with pytest.raises(ApcscoreError) as err:
        load_dataset(path, command, **kw)
    assert err.value.exit_code == 2
    return [line.strip() for line in str(err.value).splitlines()[1:-1]]


SCORE_LINES = [
    '{"id": "a", "prompt": "Hello world"}',
    '',
    '{"id": 7, "prompt_token_ids": [1, 2, 3]}',
    '   ',
    '{"context": "2+2=", "continuation": " 4"}',
    '{"id": "q1", "context": "Sky is", "choices": [" blue", " green"], "answer": 0}',
]


def test_valid_score_file_with_mixed_kinds(tmp_path: Path) -> None:
    path = write(tmp_path, SCORE_LINES)
    ds = load_dataset(path, "score")
    assert ds.invalid == [] and ds.warnings == []
    assert [(r.index, r.line, r.id, r.kind) for r in ds.records] == [
        (0, 1, "a", "prompt"), (1, 3, "7", "prompt_token_ids"), (2, 5, "5", "continuation"), (3, 6, "q1", "choices")]
    assert ds.records[1].fields == {"prompt_token_ids": [1, 2, 3]}
    assert ds.records[3].fields == {"context": "Sky is", "choices": [" blue", " green"], "answer": 0}
    assert ds.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert ds.num_records == 4


def test_records_equal_what_hugging_face_datasets_reads(tmp_path: Path) -> None:
    """datasets is the reference reader: on a valid file our fields are its rows (minus the filled-in nulls)."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    lines = [json.dumps({"id": f"r{i}", "context": f"ctx {i} \u2028 é", "continuation": f" c{i}"}) for i in range(5)]
    lines += [json.dumps({"id": f"p{i}", "prompt_token_ids": [i, i + 1, 50000]}) for i in range(3)]
    lines += [json.dumps({"id": "m", "context": "", "choices": ["a", "b", "c"], "answer": 2})]
    path = write(tmp_path, lines)
    ref = datasets.load_dataset("json", data_files=str(path), split="train", keep_in_memory=True,
                                cache_dir=str(tmp_path / "hf-cache"))
    ours = load_dataset(path, "score").records
    assert len(ours) == len(ref)
    for rec, row in zip(ours, ref):
        assert rec.id == row["id"]
        assert rec.fields == {k: v for k, v in row.items() if v is not None and k != "id"}


def test_generate_records_and_overrides(tmp_path: Path) -> None:
    big_seed = 2**62 + 1  # a float64 would round it
    path = write(tmp_path, [
        json.dumps({"prompt": "Hi", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
                    "seed": big_seed, "stop": ["\n", "END"]}),
        json.dumps({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Q?", "name": "x"}],
                    "stop": "\n\n", "temperature": 0}),
        json.dumps({"prompt": "x", "max_tokens": None}),  # null = absent
    ])
    ds = load_dataset(path, "generate")
    a, b, c = ds.records
    assert a.kind == "prompt" and a.fields["seed"] == big_seed and isinstance(a.fields["seed"], int)
    assert a.fields == {"prompt": "Hi", "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
                        "seed": big_seed, "stop": ["\n", "END"]}
    assert b.kind == "messages"
    assert b.fields == {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Q?"}],
                        "stop": "\n\n", "temperature": 0}
    assert c.fields == {"prompt": "x"}
    assert len(ds.warnings) == 1 and ds.warnings[0].startswith(f"{path}:2: unknown field 'messages[].name' ignored")


def test_perplexity_accepts_empty_text_and_warns_on_unknown_fields(tmp_path: Path) -> None:
    path = write(tmp_path, ['{"text": ""}', '{"text": "abc", "source": "wiki"}', '{"text": "d", "source": "x"}'])
    ds = load_dataset(path, "perplexity")
    assert [r.fields for r in ds.records] == [{"text": ""}, {"text": "abc"}, {"text": "d"}]
    assert len(ds.warnings) == 1
    assert ds.warnings[0].startswith(f"{path}:2: unknown field 'source' ignored (in 2 records)")


def test_a_text_field_gets_the_columns_hint_that_reads_it(tmp_path: Path) -> None:
    """Issue 53, item 10: a record with a `text` field and no `prompt` was refused without a word about --columns;
    the hint it gets now is one that works. Perplexity reads `text`: a `prompt` field gets the reverse hint."""
    from apcscore.io.tabular_input import parse_columns

    path = write(tmp_path, ['{"id": "a", "text": "Hello"}'])
    (problem,) = problems_of(path, "score")
    assert ("the record matches no score record kind: it has none of their fields (fields present: 'id', 'text'); to "
            "read the prompt from 'text', pass --columns prompt=text (write one of: ") in problem
    assert [r.fields for r in load_dataset(path, "score", columns=parse_columns("prompt=text")).records] == \
        [{"prompt": "Hello"}]
    (problem,) = problems_of(write(tmp_path, ['{"instruction": "Hi"}'], "i.jsonl"), "generate")
    assert "to read the prompt from 'instruction', pass --columns prompt=instruction" in problem
    (problem,) = problems_of(write(tmp_path, ['{"prompt": "Hi"}'], "p.jsonl"), "perplexity")
    assert "to read the text from 'prompt', pass --columns text=prompt" in problem
    (problem,) = problems_of(write(tmp_path, ['{"text": 3}'], "n.jsonl"), "score")  # not a string: no hint
    assert "--columns" not in problem


@pytest.mark.parametrize("command, line, expected", [
    ("score", '{"prompt": "a"', r"invalid JSON at column 15: Expecting ',' delimiter"),
    ("score", '{"prompt": "a"} {"prompt": "b"}', r"column 17: Extra data \(one record per line"),
    ("score", '{"prompt": "a"}\f', r"column 16: Extra data \(after the object the line holds \\x0c, which JSON"),
    ("score", '{"prompt": "a"}\u00a0 ', r"Extra data \(after the object the line holds \\xa0, which JSON does not"),
    ("score", '["prompt", "a"]', r"the record is a list, not a JSON object \(write one object per line: "),
    ("score", '{"prompt": 3}', r"'prompt' must be a string, got 3"),
    ("score", '{"prompt_token_ids": [1, true]}', r"'prompt_token_ids' must hold integers >= 0, but item 1 is true"),
    ("score", '{"prompt_token_ids": [1, -1]}', r"item 1 is -1"),
    ("score", '{"prompt_token_ids": []}', r"'prompt_token_ids' must not be empty"),
    ("score", '{"context": "a", "continuation": ""}', r"'continuation' must not be empty"),
    ("score", '{"context": "a", "choices": ["x"], "answer": 0}', r"'choices' must hold at least 2 choices, got 1"),
    ("score", '{"context": "a", "choices": ["x", ""], "answer": 0}', r"'choices' must hold non-empty strings"),
    ("score", '{"context": "a", "choices": ["x", "y"], "answer": 2}', r"'answer' 2 is not an index .* 0 to 1"),
    ("score", '{"context": "a", "choices": ["x", "y"], "answer": true}', r"'answer' must be an integer index"),
    ("score", '{"context": "a", "choices": ["x", "y"]}', r"a choices record needs 'answer'"),
    ("score", '{"context": "a"}', r"matches no score record kind: it has only 'context' \(write one of: "),
    ("score", '{"txt": "a"}', r"matches no score record kind: .*fields present: 'txt'"),
    ("score", '{"prompt": "a", "context": "b", "continuation": "c"}', r"fields of two kinds at once: prompt"),
    ("score", '{"prompt": "a", "context": "b"}', r"fields of two kinds at once: it is a prompt record"),
    ("score", '{"id": 1.5, "prompt": "a"}', r"'id' must be a non-empty string or an integer, got 1.5"),
    ("score", '{"id": false, "prompt": "a"}', r"'id' must be .* got false"),
    ("score", '{"prompt": "a", "prompt": "b"}', r"duplicate key 'prompt'"),
    ("generate", '{"prompt": "a", "temperature": NaN}', r"NaN is not valid JSON"),
    ("generate", '{"prompt": "a", "max_tokens": 1.0}', r"'max_tokens' must be an integer >= 0, got 1.0"),
    ("generate", '{"prompt": "a", "max_tokens": true}', r"'max_tokens' must be an integer >= 0, got true"),
    ("generate", '{"prompt": "a", "temperature": -1}', r"'temperature' must be a number >= 0"),
    ("generate", '{"prompt": "a", "top_p": 0}', r"'top_p' must be a number in \(0, 1\]"),
    # JSON has no infinity, but a number beyond a double's range parses to one (issue 53 item 4)
    ("generate", '{"prompt": "a", "temperature": 1e400}', r"'temperature' must be a finite number, not infinity"),
    ("generate", '{"prompt": "a", "temperature": -1e400}', r"'temperature' must be a finite number, not -infinity"),
    ("generate", '{"prompt": "a", "top_p": 1e400}', r"'top_p' must be a finite number, not infinity \(NaN and"),
    ("generate", '{"prompt": "a", "temperature": 1' + "0" * 400 + '}', r"'temperature' must be a finite number, "
                                                                        r"not 1000.*, beyond a float's range"),
    ("generate", '{"prompt": "a", "top_k": -1}', r"'top_k' must be an integer >= 0"),
    ("generate", '{"prompt": "a", "seed": "1"}', r"'seed' must be an integer, got \"1\""),
    ("generate", '{"prompt": "a", "stop": ["x", 1]}', r"'stop' must be a non-empty string or a list"),
    ("generate", '{"messages": []}', r"'messages' must be a non-empty list"),
    ("generate", '{"messages": [{"role": "user"}]}', r"'messages' item 0 needs a string 'content'"),
    ("generate", '{"messages": [{"role": "user", "content": "a"}], "prompt": "b"}', r"fields of two kinds"),
    ("perplexity", '{"prompt": "a"}', r"matches no perplexity record kind.*\{\"text\": str\}"),
])
def test_each_problem_names_its_line(tmp_path: Path, command: str, line: str, expected: str) -> None:
    good = {"score": '{"prompt": "ok"}', "generate": '{"prompt": "ok"}', "perplexity": '{"text": "ok"}'}[command]
    path = write(tmp_path, [good, "", line])
    (problem,) = problems_of(path, command)
    assert problem.startswith(f"{path}:3: "), problem
    assert re.search(expected, problem), problem
    assert problem.endswith(")"), problem  # every message says what to do


def test_an_infinite_number_is_an_error_row_naming_its_field(tmp_path: Path) -> None:
    """With --skip-invalid, a record whose temperature or top_p is 1e400 (infinity once parsed) is an error row that
    says which field must be finite; it never samples (at temperature infinity sampling is uniform)."""
    path = write(tmp_path, ['{"id": "ok", "prompt": "a", "temperature": 1e300}',
                            '{"id": "t", "prompt": "a", "temperature": 1e400}',
                            '{"id": "p", "prompt": "a", "top_p": -1e400}'])
    data = load_dataset(path, "generate", skip_invalid=True)
    assert [r.id for r in data.records] == ["ok"] and [r.id for r in data.invalid] == ["t", "p"]
    assert data.invalid[0].message.startswith(f"{path}:2: 'temperature' must be a finite number, not infinity")
    assert data.invalid[1].message.startswith(f"{path}:3: 'top_p' must be a finite number, not -infinity")


def test_error_lists_every_problem_up_to_20(tmp_path: Path) -> None:
    lines = ['{"prompt": "ok"}'] + [f'{{"prompt": {i}}}' for i in range(25)]
    path = write(tmp_path, lines)
    with pytest.raises(ApcscoreError) as err:
        load_dataset(path, "score")
    text = str(err.value)
    assert text.splitlines()[0] == f"{path}: 25 of 26 records are invalid; nothing was run:"
    assert f"{path}:2: 'prompt' must be a string, got 0" in text
    assert f"{path}:{MAX_LISTED_PROBLEMS + 1}:" in text and f"{path}:{MAX_LISTED_PROBLEMS + 2}:" not in text
    assert "  ... and 5 more" in text and "--skip-invalid" in text


def test_duplicate_ids_name_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, ['{"id": 1, "prompt": "a"}', '{"id": "1", "prompt": "b"}', '{"prompt": "c"}',
                            '{"id": "3", "prompt": "d"}'])
    problems = problems_of(path, "score")
    assert problems == [
        f"{path}:2: duplicate id '1': line 1 has the same id (give every record a unique id; "
        "a record without one gets its line number); this error row's id is '1#line2'",
        f"{path}:4: duplicate id '3': line 3 has the same id (give every record a unique id; "
        "a record without one gets its line number); this error row's id is '3#line4'",
    ]


def test_error_rows_of_duplicate_ids_have_ids_of_their_own(tmp_path: Path) -> None:
    """With --skip-invalid a duplicate becomes an error row under an id no other row has (the output's ids stay
    unique, as compare, show and merge require), and a later record cannot take that id either."""
    path = write(tmp_path, ['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}',
                            '{"id": "a#line2", "prompt": "z"}', '{"id": "a", "prompt": "w"}'])
    data = load_dataset(path, "score", skip_invalid=True)
    ids = [r.id for r in data.records] + [r.id for r in data.invalid]
    assert [r.id for r in data.records] == ["a"]
    assert [r.id for r in data.invalid] == ["a#line2", "a#line2#line3", "a#line4"]
    assert len(set(ids)) == len(ids) == 4
    assert "duplicate id 'a#line2': line 2 has the same id" in data.invalid[1].message


def test_unpaired_surrogates_are_refused_with_their_place(tmp_path: Path) -> None:
    """JSON allows a lone \\uD800..\\uDFFF escape, but the string it makes is not text: the tokenizer (and parquet)
    would fail the whole run on it. It is one record's problem, named by its field; a complete pair is a character."""
    path = write(tmp_path, ['{"id": "ok", "prompt": "pair \\ud83d\\ude00"}', '{"id": "s", "prompt": "bad \\udc80"}',
                            '{"id": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
                            '{"id": "x\\udfff", "prompt": "p"}'])
    data = load_dataset(path, "generate", skip_invalid=True)
    assert [(r.id, r.fields["prompt"]) for r in data.records] == [("ok", "pair \U0001f600")]
    assert [r.id for r in data.invalid] == ["s", "m", "x\\udfff"]  # an id with one is shown as its escape
    places = [r.message.split(": ", 1)[1].split(" holds")[0] for r in data.invalid]
    assert places == ["prompt", "messages[0].content", "id"]
    assert all("unpaired UTF-16 surrogate" in r.message and r.message.endswith(")") for r in data.invalid)
    for r in data.invalid:
        r.id.encode("utf-8")  # an error row's id can be written


def test_invalid_utf8_names_line_and_byte_offset(tmp_path: Path) -> None:
    data = b'{"prompt": "ok"}\r\n{"prompt": "caf\xe9"}\r\n'
    path = write(tmp_path, data)
    (problem,) = problems_of(path, "score")
    assert problem.startswith(f"{path}:2: invalid UTF-8 at byte offset 15 of the line (offset 33 in the file")
    assert data[33] == 0xE9


def test_skip_invalid_returns_invalid_records_in_order(tmp_path: Path) -> None:
    path = write(tmp_path, ['{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": 1}', '', 'not json',
                            '{"id": "d", "prompt": "y"}', '{"id": "a", "prompt": "z"}'])
    ds = load_dataset(path, "score", skip_invalid=True)
    assert [(r.index, r.line, r.id) for r in ds.records] == [(0, 1, "a"), (3, 5, "d")]
    assert [(r.index, r.line, r.id) for r in ds.invalid] == [(1, 2, "b"), (2, 4, "#line4"), (4, 6, "a#line6")]
    assert ds.invalid[1].message.startswith(f"{path}:4: invalid JSON at column 1")
    assert ds.num_records == 5


def test_a_stand_in_id_never_takes_a_real_one(tmp_path: Path) -> None:
    """Issue 46, item 3: an error row whose record gave no usable id (a line that does not parse, an id of the
    wrong type, none on an invalid record) took its line number as id, and a valid record giving that id later
    became a duplicate. Its stand-in is `#lineN`, given once every real id is known (suffixed if one is it)."""
    path = write(tmp_path, ['{"id": true, "prompt": "x"}', '{"id": "1", "prompt": "y"}', '{"prompt": ',
                            '{"id": 3, "prompt": "z"}', '{"prompt": 5}', '{"id": "#line5", "prompt": "w"}'])
    ds = load_dataset(path, "score", skip_invalid=True)
    assert [(r.line, r.id) for r in ds.records] == [(2, "1"), (4, "3"), (6, "#line5")]
    assert [(r.line, r.id) for r in ds.invalid] == [(1, "#line1"), (3, "#line3"), (5, "#line5.2")]
    assert not any("duplicate" in r.message for r in ds.invalid)
    ids = [r.id for r in ds.records] + [r.id for r in ds.invalid]
    assert len(ids) == len(set(ids)) == 6  # one row per record, each under an id of its own


def test_limit_keeps_the_first_records_valid_or_not(tmp_path: Path) -> None:
    path = write(tmp_path, ['{"prompt": "a"}', '', '{"prompt": 1}', '{"prompt": "c"}', '{"prompt": 2}'])
    ds = load_dataset(path, "score", skip_invalid=True, limit=2)
    assert [r.line for r in ds.records] == [1] and [r.line for r in ds.invalid] == [3]
    assert ds.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()  # of the whole file
    assert len(load_dataset(path, "score", limit=1).records) == 1  # the bad lines beyond the limit are not read
    with pytest.raises(ApcscoreError, match="--limit"):
        load_dataset(path, "score", limit=0)


@pytest.mark.parametrize("data, expected", [
    (b"", "has no records"),
    (b"\n  \n\r\n", "has no records"),
    ('{"prompt": "a"}\n'.encode("utf-16"), "UTF-16"),
    (b'{"prompt": "a\x00"}\n', "NUL bytes"),
    (b'\xff\xff\n\x80\n', "no line decodes as UTF-8"),
])
def test_file_level_problems_raise_even_with_skip_invalid(tmp_path: Path, data: bytes, expected: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(ApcscoreError, match=expected) as err:
        load_dataset(path, "score", skip_invalid=True)
    assert err.value.exit_code == 2


def test_missing_file_directory_and_bom(tmp_path: Path) -> None:
    with pytest.raises(ApcscoreError, match="does not exist"):
        load_dataset(tmp_path / "nope.jsonl", "score")
    with pytest.raises(ApcscoreError, match="is a directory"):
        load_dataset(tmp_path, "score")
    path = write(tmp_path, b'\xef\xbb\xbf{"prompt": "a"}\n')
    assert load_dataset(path, "score").records[0].fields == {"prompt": "a"}


def test_loading_holds_one_copy_of_the_data(tmp_path: Path) -> None:
    """No transient second copy: the peak while loading is close to what the records keep."""
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(5_000):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"The quick brown fox jumps over the lazy dog {i}"}) + "\n")
    tracemalloc.start()
    try:
        ds = load_dataset(path, "score")
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ds.records) == 5_000
    assert peak < 1.5 * current, (current, peak)
    assert current < 800 * 5_000  # a small object per record: ~470 bytes each with its prompt and id


json_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
score_record = st.one_of(
    st.fixed_dictionaries({"prompt": json_text}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 2**40), min_size=1, max_size=5)}),
    st.fixed_dictionaries({"context": json_text, "continuation": json_text.filter(bool)}),
    st.lists(json_text.filter(bool), min_size=2, max_size=4).flatmap(lambda ch: st.fixed_dictionaries(
        {"context": json_text, "choices": st.just(ch), "answer": st.integers(0, len(ch) - 1)})),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(score_record, min_size=1, max_size=6), st.booleans())
def test_valid_records_round_trip(tmp_path: Path, recs: list[dict], ascii_only: bool) -> None:
    path = write(tmp_path, [json.dumps(r, ensure_ascii=ascii_only) for r in recs])
    ds = load_dataset(path, "score")
    assert [r.fields for r in ds.records] == recs
    assert [r.line for r in ds.records] == list(range(1, len(recs) + 1))
