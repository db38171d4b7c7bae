"""`apcscore compare --report-html`: the page's content from a real compare of two tiny-model score runs, and the
page as headless Chromium renders it (plotly's SVGs drawn, tokens with their top-K, the flips table, a click pinning
a token, a screenshot).

The runs: a tiny random Llama (fp32) against a copy whose weights carry seeded noise (a stand-in for a fine-tune or
a quantization), both `apcscore score --prompt-logprobs 3` on prompts and multiple-choice records, so KL, Δ logprob
and flips are real. The browser tests skip, saying so, where no Chromium is installed (.ci/run installs Debian's).
"""

from __future__ import annotations

import base64
import html as html_lib
import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.compare import html_report
from apcscore.compare.gate import compare_files
from apcscore.compare.thresholds import Thresholds
from test_compare import TinyLM, make_records, score_rows, write_results

PROMPTS = [
    {"id": "capital", "prompt": "The capital of France is Paris. The capital of Germany is <Berlin> & \"Bonn\"."},
    {"id": "code", "prompt": "def add(a, b):\n    return a + b\n"},
    {"id": "count", "prompt": "One, two, three, four, five, six, seven, eight, nine, ten."},
    {"id": "q2", "context": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"id": "q4", "context": "Cats say", "choices": [" meow", " moo", " quack", " woof"], "answer": 0},
    {"id": "q5", "context": "</script><b>pick</b>", "choices": [" a", " b"], "answer": 1},
]
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="no headless browser installed (chromium, "
                                   "chromium-browser or google-chrome on PATH); .ci/run installs Debian's chromium")


def perturbed_copy(src: Path, dst: Path, scale: float = 0.3) -> Path:
    """The model folder with seeded Gaussian noise (scale x each tensor's std) added to every weight."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    noisy = {k: v + scale * v.std() * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(baseline parquet, candidate parquet, a folder for outputs)."""
    tmp = tmp_path_factory.mktemp("html-report")
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    base_model = tiny_model_dir("llama")
    models = {"base": base_model, "new": perturbed_copy(base_model, tmp / "tiny-llama-noisy")}
    out = {}
    for side, model in models.items():
        out[side] = tmp / f"{side}.parquet"
        r = CliRunner().invoke(app, ["score", str(data), "--model", str(model), "--device", "cpu",
                                     "--prompt-logprobs", "3", "--out", str(out[side]), "--quiet"])
        assert r.exit_code == 0, r.output
    return out["base"], out["new"], tmp


def report(runs, *extra: str) -> tuple[Path, object]:
    """Run `compare --report-html` through the CLI; the page's path and the CliRunner result."""
    base, new, tmp = runs
    page = tmp / "report" / "compare.html"
    r = CliRunner().invoke(app, ["compare", str(base), str(new), "--max-mean-kld", "0.001", "--max-accuracy-drop",
                                 "0.5", "--no-default-gate", "--report-html", str(page), *extra],
                           env={"COLUMNS": "200"})
    return page, r


def spans(page: str) -> list[tuple[str, str, str]]:
    """(class, title, text) of every token span."""
    return re.findall(r'<span class="(tok[^"]*)"(?: style="[^"]*")? title="([^"]*)">([^<]*)</span>', page)


@pytest.mark.slow
def test_page_holds_verdict_checks_tokens_and_flips(runs) -> None:
    base, new, _ = runs
    page, r = report(runs)
    assert r.exit_code == 1, r.output  # the KL threshold fails: the page says so too
    html = page.read_text(encoding="utf-8")
    c = compare_files(base, new, Thresholds(max_mean_kld=0.001, max_accuracy_drop=0.5))
    assert not c.passed and c.flips, "the fixture should give a failing check and at least one flip"
    assert re.search(r'<span class="verdict fail" id="verdict">FAIL \(1 of 5 thresholds\)</span>', html)
    assert "<title>apcscore compare: FAIL (1 of 5 thresholds)</title>" in html
    checks = re.search(r'<table id="thresholds">(.*?)</table>', html, re.S).group(1)
    assert checks.count("<tr") == 1 + len(c.checks) and '<tr class="fail"><td>--max-mean-kld</td>' in checks
    # self-contained: plotly.js inlined, nothing fetched from the network
    assert not re.search(r'<(script|img|iframe)[^>]*\ssrc="?(https?:)?//', html)
    assert not re.search(r'<link[^>]*\shref="?(https?:)?//', html)
    assert "Plotly.newPlot" in html and len(html) > 3_000_000
    for div in ("plot-dlogprob", "plot-kl", "plot-scatter"):
        assert f'id="{div}"' in html
    # the worst records, token by token: every token of each record, escaped, with both top-K lists on hover
    ids = {rec["id"]: rec for rec in PROMPTS}
    tokens = spans(html)
    n_tokens = sum(len(row["token_ids"]) for row in _rows(base) if row["token_ids"])
    assert len(tokens) == n_tokens
    scored = [t for t in tokens if t[0] == "tok"]
    assert len(scored) == c.metrics.num_positions
    assert all("baseline top-3:" in title and "candidate top-3:" in title for _, title, _ in scored)
    assert "&lt;Berlin&gt; &amp; &quot;Bonn&quot;" in "".join(text for _, _, text in tokens)
    assert "<Berlin>" not in html and "</script><b>" not in html
    texts = html_lib.unescape("".join(text for _, _, text in tokens).replace("↵", ""))
    for rid in ("capital", "code", "count"):
        assert ids[rid]["prompt"] in texts
    # the flips, one table row each
    flips = re.search(r'<table id="flips">(.*?)</table>', html, re.S).group(1)
    assert flips.count("<tr") == 1 + len(c.flips)
    for f in c.flips:
        assert f"<td>{f.id}</td><td>{f.kind}</td>" in flips
    # the other reports are unchanged by what the page needs
    js = page.with_suffix(".json")
    assert report(runs, "--report-json", str(js))[1].exit_code == 1
    assert "aligned" not in json.loads(js.read_text())


def _rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def test_without_the_tokenizer_tokens_are_ids(runs, tmp_path) -> None:
    import pyarrow.parquet as pq

    base, new, _ = runs
    moved = []
    for src in (base, new):  # the files copied to a machine without the model folders
        t = pq.read_table(src)
        meta = json.loads(t.schema.metadata[b"apcscore"])
        meta["model"]["path"] = meta["tokenizer"]["name_or_path"] = str(tmp_path / "gone")
        dst = tmp_path / src.name
        pq.write_table(t.replace_schema_metadata({b"apcscore": json.dumps(meta)}), dst)
        moved.append(dst)
    page = tmp_path / "r.html"
    r = CliRunner().invoke(app, ["compare", *map(str, moved), "--report-html", str(page), "--no-default-gate"])
    assert r.exit_code == 0, r.output
    html = page.read_text(encoding="utf-8")
    assert "note: tokens are shown as ids: the tokenizer folder" in html
    first = _rows(base)[0]["token_ids"]
    assert "".join(f"⟨{t}⟩" for t in first[:3]) in "".join(text for _, _, text in spans(html))


def test_long_records_and_many_positions_are_cut(tmp_path, monkeypatch) -> None:
    """A record longer than MAX_TOKENS shows a window around its largest change; the scatter keeps MAX_SCATTER
    points (synthetic files of test_compare's tiny LM in fp32 and bf16)."""
    import torch

    model, records = TinyLM(), make_records(6)
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 2))
    new = write_results(tmp_path / "b.parquet", score_rows(model, records, torch.bfloat16, 2), dtype="bfloat16")
    c = compare_files(base, new)
    monkeypatch.setattr(html_report, "MAX_TOKENS", 10)
    monkeypatch.setattr(html_report, "MAX_SCATTER", 50)
    html = html_report.to_html(c, worst=2)
    assert 'id="verdict">PASS<' in html
    assert len(spans(html)) == 2 * 10 and "around the largest change" in html
    scatter = json.loads(re.search(r'Plotly.newPlot\(\s*"plot-scatter",\s*(\[.*?\]),\s*\{', html, re.S).group(1))
    x = scatter[1]["x"]  # plotly 6+ writes numpy arrays as base64 typed arrays
    n = len(base64.b64decode(x["bdata"])) // np.dtype(x["dtype"]).itemsize if isinstance(x, dict) else len(x)
    assert n == 50 and "50 of" in html


# ----------------------------------------------------------------------------------------------------------
# In a real browser
# ----------------------------------------------------------------------------------------------------------


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"  # a fresh profile per run
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def png_facts(path: Path) -> tuple[int, int, int]:
    """(width, height, number of distinct byte values in the image data) of a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat, i = b"", 8
    while i < len(data):
        (n,), kind = struct.unpack(">I", data[i:i + 4]), data[i + 4:i + 8]
        if kind == b"IDAT":
            idat += data[i + 8:i + 8 + n]
        i += 12 + n
    return width, height, len(set(zlib.decompress(idat)))


@needs_browser
def test_page_in_headless_chromium(runs, tmp_path) -> None:
    page, r = report(runs)
    assert r.exit_code == 1, r.output
    c = compare_files(runs[0], runs[1])
    # the DOM after scripts ran: plotly drew each chart; a click (injected) pins a token's details
    clicked = tmp_path / "clicked.html"
    clicked.write_text(page.read_text(encoding="utf-8").replace(
        "</body>", '<script>document.querySelector(".tok:not(.na)").click()</script></body>'), encoding="utf-8")
    dom = chromium(tmp_path, "--dump-dom", clicked.as_uri()).stdout
    assert re.search(r'id="verdict">FAIL \(1 of 5 thresholds\)<', dom)
    for div in ("plot-dlogprob", "plot-kl", "plot-scatter"):
        start = dom.index(f'id="{div}"')
        end = dom.find('id="plot-', start + 1)
        drawn = dom[start:end if end > 0 else None]
        assert 'class="main-svg"' in drawn, f"plotly drew no SVG in {div}"
        if div == "plot-scatter":  # a marker per position compared
            assert drawn.count('class="point plotly-customdata"') == c.metrics.num_positions
        else:
            assert 'class="trace bars"' in drawn and drawn.count('class="point"') > 5
    tokens = spans(dom)
    assert len(tokens) > 30 and all("top-3:" in title for cls, title, _ in tokens if cls == "tok")
    pinned = re.search(r'<pre id="pin-text"[^>]*>(.*?)</pre>', dom, re.S).group(1)
    assert pinned.startswith("record capital, position 1:") and "candidate top-3:" in pinned
    assert re.search(r'<table id="flips">.*?<td>q\d</td>', dom, re.S)
    # a screenshot for people to look at (kept with the CI artefacts when APCSCORE_TEST_ARTIFACTS is set)
    shot = tmp_path / "compare_report.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,2000", page.as_uri())
    width, height, values = png_facts(shot)
    assert (width, height) == (1400, 2000) and shot.stat().st_size > 50_000 and values > 100
    if os.environ.get("APCSCORE_TEST_ARTIFACTS"):
        dest = Path(os.environ["APCSCORE_TEST_ARTIFACTS"])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, dest / shot.name)
        shutil.copy(page, dest / "compare_report.html")


def test_infinite_logprobs_are_counted_not_drawn(tmp_path) -> None:
    """Issue 42 item 20: a ±inf logprob in either file made np.histogram raise, so there was no page."""
    import torch

    model, records = TinyLM(), make_records(3)
    b, n = score_rows(model, records, torch.float32, 2), score_rows(model, records, torch.bfloat16, 2)
    n[0]["token_logprobs"][3] = float("-inf")  # Δ -inf
    b[1]["token_logprobs"][2] = float("-inf")  # Δ +inf
    b[2]["token_logprobs"][4] = n[2]["token_logprobs"][4] = float("-inf")  # Δ NaN
    base = write_results(tmp_path / "a.parquet", b)
    new = write_results(tmp_path / "b.parquet", n, dtype="bfloat16")
    c = compare_files(base, new)
    html = html_report.to_html(c, worst=3)
    # they are broken numbers now (issue 52): left out of every figure, counted, and the gate fails
    assert c.broken.positions == 3 and not c.passed
    assert "3 position(s) and 3 record(s) hold broken numbers" in html
    assert len(spans(html)) == sum(len(r["token_ids"]) for r in b)


def test_the_page_stays_under_its_bound_and_says_what_it_left_out(tmp_path, monkeypatch) -> None:
    """Issue 42 item 21: at K=20 the default 10 worst records of 1,024 tokens made a ~20 MB page, --worst was
    unbounded, and the flips and excluded tables listed every row."""
    import torch

    from test_compare import VOCAB

    rng = np.random.default_rng(0)
    model = TinyLM()
    records = {f"r{i}": rng.integers(0, VOCAB, 1024).tolist() for i in range(10)}
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 20))
    new = write_results(tmp_path / "b.parquet", score_rows(model, records, torch.bfloat16, 20), dtype="bfloat16")
    c = compare_files(base, new)
    html = html_report.to_html(c)  # the default --worst 10
    assert len(html.encode()) <= 10_000_000
    shown = len(re.findall(r'<div class="record"', html))
    assert 1 <= shown < 10 and f"{shown} of the 10 records are shown token by token: the next would take the page " \
        "over 10 MB (the table above lists all 10)" in html
    # the tables: at most MAX_TABLE_ROWS rows each, --worst however large
    from apcscore.compare.inputs import Excluded
    from apcscore.compare.metrics import Flip

    monkeypatch.setattr(html_report, "MAX_TABLE_ROWS", 3)
    c.flips = [Flip(f"f{i}", "acc", 0, 0, 1, True, False) for i in range(5)]
    c.excluded = [Excluded(f"x{i}", "both", "failed") for i in range(4)]
    html = html_report.to_html(c, worst=1_000_000)
    assert "<h2>Worst 3 records</h2>" in html and len(re.findall(r'<div class="record"', html)) <= 3
    assert "... and 7 more of the worst records, not listed: the page lists at most 3 (the JSON report, " \
        "--report-json, has them all)" in html
    assert "... and 2 more flips, not listed" in html and "... and 1 more excluded records, not listed" in html
    assert "<td>f2</td>" in html and "<td>f3</td>" not in html
    assert "<td>x2</td>" in html and "<td>x3</td>" not in html
