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

from apcscore.compare.exact import exact_files
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
