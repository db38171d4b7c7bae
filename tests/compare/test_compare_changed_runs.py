"""`apcscore compare` on runs that differ in more than the model (issue 52, items 4 and 5): the report says what
differs between the runs (version, code, weights, dtype, device, numerics, top-K, dataset), `--exact` compares
runs of another K on their common top-K, and changed datasets are named, or compared on their common records with
`--common-records`.

The files are written with the fixture writer of test_compare.py (the schema `apcscore score` writes) from its tiny
random "language model"."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import torch
from test_compare import TinyLM, make_records, one_line, run_cli, score_rows, write_results

from apcscore.compare.gate import exact_files
from apcscore.compare.gate import compare_files


def _meta(**over) -> dict:
    """Run metadata as `apcscore score` writes it (the keys the "runs differ in" block reads)."""
    meta = {"apcscore_version": "0.1.0", "device": "cpu", "model_backend": "native", "attention_backend": "torch",
            "code": {"kernels": "411b9be15136b6bf", "matmul_configs": "3dd12e2fdaf2e0ab", "models": "65fc11edb6bcca4e"},
            "model": {"name": "tiny-random", "vocab_size": 50, "fingerprint": "a672150fb4f99d7c"},
            "numerics": {"batch_invariant": True, "portable": True, "math": "apcscore portable math v1",
                         "simd": "avx512-fma", "torch_threads": 2, "blas": {"library": "mkl 2024.2"}}}
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(meta.get(key), dict):
            meta[key] = {**meta[key], **value}
        else:
            meta[key] = value
    return meta


def test_the_reports_say_what_differs_between_the_runs(tmp_path) -> None:
    model, records = TinyLM(), make_records()
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 5), meta=_meta())
    new = write_results(tmp_path / "b.parquet", score_rows(model, records, torch.bfloat16, 3), dtype="bfloat16",
                        meta=_meta(apcscore_version="0.2.0", device="cuda:0", code={"kernels": "0123456789abcdef"},
                                   model={"fingerprint": "ffff0000ffff0000"},
                                   numerics={"portable": False, "simd": None}))
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    r = run_cli(base, new, "--report-md", md, "--report-json", js)
    assert r.exit_code == 0, r.output
    want = [("apcscore version", "0.1.0", "0.2.0"), ("numerics code: kernels", "411b9be15136b6bf", "0123456789abcdef"),
            ("weights fingerprint", "a672150fb4f99d7c", "ffff0000ffff0000"), ("dtype", "float32", "bfloat16"),
            ("device", "cpu", "cuda:0"), ("numerics: portable", "true", "false"),
            ("numerics: simd", "avx512-fma", None), ("top-K stored", "5", "3")]
    data = json.loads(js.read_text())
    assert [(d["property"], d["baseline"], d["candidate"]) for d in data["run_differences"]] == want
    text = md.read_text()
    assert "### Runs differ in" in text
    for name, b, n in want:
        assert f"| {name} | {b} | {n or '(not recorded)'} |" in text
    html = tmp_path / "r.html"
    assert run_cli(base, new, "--report-html", html).exit_code == 0
    page = html.read_text()
    assert '<h2>Runs differ in</h2><table id="differ">' in page and "<td>ffff0000ffff0000</td>" in page
    out = one_line(r.output)
    assert "Runs differ in" in out and "weights fingerprint a672150fb4f99d7c ffff0000ffff0000" in out
    # the same run twice: nothing differs, and the reports say so in one sentence
    r = run_cli(base, base, "--report-md", md, "--report-json", js)
    assert r.exit_code == 0 and "the runs differ in nothing their metadata records" in one_line(r.output)
    assert json.loads(js.read_text())["run_differences"] == []
    assert "_the runs differ in nothing their metadata records" in md.read_text()


def test_exact_with_another_top_k_compares_the_common_top_k(tmp_path) -> None:
    """Issue 52, item 4: `--exact` of a K = 10 run against a K = 5 run of the same bits reported every record as
    different; it now compares their common top-5 and says so, and still fails on a real difference."""
    model, records = TinyLM(), make_records()
    k5 = write_results(tmp_path / "k5.parquet", score_rows(model, records, torch.float32, 5))
    k10 = write_results(tmp_path / "k10.parquet", score_rows(model, records, torch.float32, 10))
    diff = exact_files(k10, k5)
    assert diff.passed, diff.summary()
    assert diff.notes == ["--exact: the baseline stores top-10 and the candidate top-5: top_ids, top_logprobs "
                          "compared on their first 5 entries (the common top-5)"]
    r = run_cli(k10, k5, "--exact")
    assert r.exit_code == 0, r.output
    assert "compared on their first 5 entries (the common top-5)" in one_line(r.output)
    # a change inside the common top-5 still fails: one top logprob of one record, one bit
    rows = score_rows(model, records, torch.float32, 5)
    rows[3]["top_logprobs"][7][2] = float(torch.tensor(rows[3]["top_logprobs"][7][2]).nextafter(torch.tensor(0.0)))
    moved = write_results(tmp_path / "moved.parquet", rows)
    diff = exact_files(k10, moved)
    assert not diff.passed and diff.num_differing_records == 1
    assert (diff.first.id, diff.first.column, diff.first.position) == ("r3", "top_logprobs", 7)
    # a change beyond the common top-5 (in the K = 10 run's entries 6-10) is not seen: it is not in both files
    rows10 = score_rows(model, records, torch.float32, 10)
    rows10[2]["top_ids"][4][8] = 0
    other = write_results(tmp_path / "k10b.parquet", rows10)
    assert exact_files(other, k5).passed
    # bf16 against fp32 at K 10 / 5: the dtype's differences, in every record, as before
    bf = write_results(tmp_path / "bf.parquet", score_rows(model, records, torch.bfloat16, 5), dtype="bfloat16")
    diff = exact_files(k10, bf)
    assert not diff.passed and diff.first.column == "token_logprobs"
    assert [len(pq.read_table(f)["top_ids"].to_pylist()[1][1]) for f in (k10, k5)] == [10, 5]  # the two Ks


# ---------------------------------------------------------------------------------------------------------
# Datasets that changed (item 5)
# ---------------------------------------------------------------------------------------------------------


def _dataset_edit(tmp_path):
    """A baseline on 8 records, and a candidate on a changed dataset: r3 edited (one token), r6 and r7 gone, x1 new,
    the rows in another order."""
    model, records = TinyLM(), make_records()
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 5))
    changed = {k: v for k, v in records.items() if k not in ("r6", "r7")}
    changed["r3"] = [t if i != 4 else (t + 1) % 50 for i, t in enumerate(records["r3"])]
    changed["x1"] = records["r6"][:20]
    rows = score_rows(model, changed, torch.bfloat16, 5)[::-1]
    new = write_results(tmp_path / "b.parquet", rows, dtype="bfloat16", dataset_sha256="cd" * 32)
    return model, records, base, new


def test_a_reordered_file_compares_as_the_ordered_one(tmp_path) -> None:
    """docs/compare.md promises that records are joined by id: the CLI's reports of a reordered candidate (with an
    error row and the ids shuffled) are those of the ordered one, record by record."""
    model, records = TinyLM(), make_records()
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 5))
    rows = score_rows(model, records, torch.bfloat16, 5)
    rows[2] = {"id": "r2", "status": "error", "error": "out of memory"}
    ordered = write_results(tmp_path / "b.parquet", rows)
    shuffled = write_results(tmp_path / "c.parquet", [rows[i] for i in (5, 0, 7, 2, 1, 6, 3, 4)])
    reports = []
    for new in (ordered, shuffled):
        js = tmp_path / f"{new.stem}.json"
        r = run_cli(base, new, "--report-json", js, "--max-new-errors", 1)
        assert r.exit_code == 0, r.output
        data = json.loads(js.read_text())
        for side in ("base", "new"):
            data[side].pop("path")
        reports.append(data)
    assert reports[0] == reports[1]
    assert reports[0]["num_compared"] == 7 and reports[0]["excluded"][0]["id"] == "r2"


def test_a_changed_dataset_is_refused_naming_the_records_and_the_option(tmp_path) -> None:
    _, _, base, new = _dataset_edit(tmp_path)
    r = run_cli(base, new)
    assert r.exit_code == 2
    err = one_line(r.stderr)
    assert "the files are runs on different datasets" in err
    assert "2 only in the baseline ('r6', 'r7')" in err and "1 only in the candidate ('x1')" in err
    assert "1 edited (same id, another input): 'r3' (token_ids differ from position 4)" in err
    assert "or pass --common-records to compare the 5 record(s) present and identical in both" in err


def test_missing_or_edited_records_of_one_dataset_are_named(tmp_path) -> None:
    """The same dataset hash (or none recorded), but a record missing or edited: named, with the option."""
    model, records = TinyLM(), make_records()
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 5))
    rows = score_rows(model, records, torch.float32, 5)
    fewer = write_results(tmp_path / "b.parquet", rows[:-1])
    err = one_line(run_cli(base, fewer).stderr)
    assert "record ids 1 only in the baseline ('r7')" in err and "--common-records to compare the 7 record(s)" in err
    # a multiple-choice record whose answer changed is another record, not a regression
    from test_compare import mc_rows

    a = write_results(tmp_path / "mc_a.parquet", mc_rows([0, 1, 2], [0, 1, 2], [0, 1, 2]))
    b = write_results(tmp_path / "mc_b.parquet", mc_rows([0, 1, 2], [0, 1, 2], [0, 1, 1]))
    r = run_cli(a, b)
    assert r.exit_code == 2
    assert "record 'q2': answer 2 in the baseline, 1 in the candidate" in one_line(r.stderr)


def test_common_records_compares_what_both_files_hold_alike_and_lists_the_rest(tmp_path) -> None:
    model, records, base, new = _dataset_edit(tmp_path)
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    r = run_cli(base, new, "--common-records", "--report-md", md, "--report-json", js)
    assert r.exit_code == 0, r.output
    data = json.loads(js.read_text())
    assert data["num_compared"] == 5
    assert data["left_out"] == {"only_baseline": ["r6", "r7"], "only_candidate": ["x1"],
                                "edited": [["r3", "token_ids differ from position 4"]]}
    assert any(n.startswith("--common-records: 4 record(s) not present and identical in both files left out")
               for n in data["notes"])
    text = md.read_text()
    assert "### Records left out (--common-records)" in text
    assert "| r3 | edited: token_ids differ from position 4 |" in text
    assert "| x1 | only in the candidate |" in text
    out = one_line(r.output)
    assert "Records left out (--common-records)" in out and "r6 only in the baseline" in out
    # the figures are those of the five common records compared directly
    keep = ("r0", "r1", "r2", "r4", "r5")
    sub = {k: records[k] for k in keep}
    a = write_results(tmp_path / "sa.parquet", score_rows(model, sub, torch.float32, 5))
    b = write_results(tmp_path / "sb.parquet", score_rows(model, sub, torch.bfloat16, 5))
    direct = compare_files(a, b).to_dict()["metrics"]
    assert data["metrics"] == direct
    # --exact on the common records: bf16 differs in them; the same data passes
    r = run_cli(base, new, "--common-records", "--exact")
    assert r.exit_code == 1 and "--exact: 5 of 5 records differ" in one_line(r.output)
    same = write_results(tmp_path / "same.parquet", score_rows(model, sub, torch.float32, 5),
                         dataset_sha256="ef" * 32)
    r = run_cli(base, same, "--common-records", "--exact")
    assert r.exit_code == 0 and "all 5 records are bit-identical" in one_line(r.output)


def test_common_records_keeps_new_errors_and_refuses_when_nothing_is_common(tmp_path) -> None:
    model, records = TinyLM(), make_records()
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 5))
    rows = score_rows(model, records, torch.float32, 5)
    rows[1] = {"id": "r1", "status": "error", "error": "prompt too long"}  # no token_ids: an error, not an edit
    new = write_results(tmp_path / "b.parquet", rows[:-1], dataset_sha256="cd" * 32)
    r = run_cli(base, new, "--common-records")
    assert r.exit_code == 1  # the new error still fails --max-new-errors 0
    assert "only in the baseline ('r7')" in one_line(r.output) and "edited" not in one_line(r.output)
    other = write_results(tmp_path / "c.parquet", [dict(row, id=f"x{i}") for i, row in enumerate(rows)])
    r = run_cli(base, other, "--common-records")
    assert r.exit_code == 2
    assert "--common-records: no record is present and identical in both files" in one_line(r.stderr)
