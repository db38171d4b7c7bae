"""`apcscore compare --report-html`: the comparison as one self-contained HTML page, plotly.js inlined, under
MAX_PAGE_BYTES (docs/compare.md, "Reports" says what it holds and leaves out). Every text from the files is escaped."""

from __future__ import annotations

import html
import json
import math

import numpy as np
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from apcscore.compare.gate import Comparison
from apcscore.compare.html_assets import CSS, JS
from apcscore.compare.metrics import RecordMetrics
from apcscore.compare.report import (CHECK_HEAD, DIFFER_HEAD, EXCLUDED_HEAD, LEFT_OUT_HEAD, _FLIP_HEAD, _WORST_HEAD,
                                     Row, _differ_rows, _excluded_rows, _extra_tables, _flip_rows, _left_out_rows,
                                     _metric_rows, _sides, _worst_rows, check_rows, differ_line, verdict)
from apcscore.io.token_text import Texts, id_texts

MAX_SCATTER = 20_000  # points of the logprob scatter: the largest |Δ| and a random sample of the rest
MAX_TOKENS = 1024  # tokens shown of one record: a window around its largest |Δ|
BINS = 60
MAX_PAGE_BYTES = 10_000_000  # the page's bound (plotly.js is ~4.8 MB of it); token views fill what is left
MAX_TABLE_ROWS = 500  # rows of the worst, flips and excluded tables
_RED, _BLUE = (220, 38, 38), (37, 99, 235)


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _table(head: Row, rows: list[Row], classes: list[str] | None = None, table_id: str | None = None) -> str:
    """An HTML table of text cells; numbers right-aligned."""
    def cell(x: str) -> str:
        num = x[:1].isdigit() or (x[:1] in "+-" and x[1:2].isdigit())
        return f'<td class="num">{_e(x)}</td>' if num else f"<td>{_e(x)}</td>"

    attr = f' id="{table_id}"' if table_id else ""
    out = [f"<table{attr}>", "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(cell(x) for x in row) + "</tr>")
    return "\n".join(out + ["</table>"])


# ---- Charts (plotly); histograms are binned here, so the page holds counts, not every position ----


def _histogram(values: np.ndarray, title: str, xlabel: str, color: str) -> go.Figure:
    """Counts of the finite values in BINS bins; the others (±inf, NaN: a -inf logprob on one side) are counted in
    the title, since no bin holds them."""
    finite = np.isfinite(values)
    if not finite.all():
        title += f" ({int((~finite).sum()):,} not finite, not drawn)"
    counts, edges = np.histogram(values[finite], bins=BINS)
    fig = go.Figure(go.Bar(x=(edges[:-1] + edges[1:]) / 2, y=counts, width=np.diff(edges), marker_color=color,
                           hovertemplate="%{x:.4g}: %{y} positions<extra></extra>"))
    fig.update_layout(title=title, xaxis_title=xlabel, yaxis_title="positions (log scale)", yaxis_type="log",
                      bargap=0.02)
    return fig


def _scatter(c: Comparison) -> go.Figure | None:
    pos = c.aligned.positions
    keep = np.flatnonzero(np.isfinite(pos.base_lp) & np.isfinite(pos.new_lp))  # a -inf logprob has no place
    m = len(keep)
    if not m:
        return None
    title = f"Target-token logprob, {m:,} positions"
    if m > MAX_SCATTER:  # the largest changes, and a fixed random sample of the rest
        order = keep[np.argsort(-np.abs(pos.new_lp - pos.base_lp)[keep], kind="stable")]
        top, rest = order[:MAX_SCATTER // 10], order[MAX_SCATTER // 10:]
        sample = np.random.default_rng(0).choice(rest, MAX_SCATTER - len(top), replace=False)
        keep = np.sort(np.concatenate([top, sample]))
        title = (f"Target-token logprob, {MAX_SCATTER:,} of {m:,} positions "
                 f"(the {len(top):,} largest |Δ| and a random sample)")
    if off := len(pos.record) - m:
        title += f"; {off:,} with a logprob not finite, not drawn"
    ids = c.aligned.base["id"].to_pylist()
    x, y = pos.base_lp[keep], pos.new_lp[keep]
    custom = [[_e(ids[r]), int(p)] for r, p in zip(pos.record[keep], pos.position[keep])]
    lo, hi = float(min(x.min(), y.min())), float(max(x.max(), y.max()))
    fig = go.Figure([
        go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line=dict(color="#8c959f", dash="dot"), name="equal",
                   hoverinfo="skip"),
        go.Scatter(x=x, y=y, mode="markers", marker=dict(size=5, color="#0969da", opacity=0.6), name="position",
                   customdata=custom, hovertemplate="record %{customdata[0]}, position %{customdata[1]}<br>"
                   "baseline %{x:.4f}<br>candidate %{y:.4f}<extra></extra>"),
    ])
    fig.update_layout(title=title, xaxis_title="baseline logprob", yaxis_title="candidate logprob", showlegend=False)
    return fig


def _figures(c: Comparison) -> list[tuple[str, go.Figure]]:
    """(div id, plotly figure) of every chart the data allows."""
    pos = c.aligned.positions if c.aligned is not None else None
    if pos is None or not len(pos.record):
        return []
    figs = [("plot-dlogprob", _histogram(pos.new_lp - pos.base_lp, "Δ logprob per token (candidate − baseline)",
                                         "Δ logprob, nats", "#0969da"))]
    kl = pos.kld[~np.isnan(pos.kld)]
    if len(kl):
        figs.append(("plot-kl", _histogram(kl, f"KL(base ‖ new) per token ({c.kl_label})", "KL, nats",
                                           "#8250df")))
    if (scatter := _scatter(c)) is not None:
        figs.append(("plot-scatter", scatter))
    return figs


def _plot_divs(figs: list[tuple[str, go.Figure]]) -> str:
    divs = []
    for div_id, fig in figs:
        # the title below plotly's tool bar (top right), which would cover its end
        fig.update_layout(template="plotly_white", margin=dict(l=60, r=20, t=64, b=50), title_font_size=13,
                          title_y=0.91, title_yanchor="top", title_x=0.02)
        body = fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                           config={"displaylogo": False, "responsive": True})
        divs.append(f'<div class="plot">{body}</div>')
    return '<div class="plots">' + "\n".join(divs) + "</div>"


# ---- Worst records, token by token ----


def _shown(text: str) -> str:
    """A token's text for the page: escaped, a newline marked, never empty."""
    return _e(text).replace("\n", "↵\n") if text else "∅"


def _top_lines(label: str, ids: list[int] | None, lps: list[float] | None, target: int, text: dict[int, str]) -> str:
    if not ids:
        return f"{label}: no top-K stored"
    rows = [f"  {lp:9.4f}  {json.dumps(text[t], ensure_ascii=False)}{'  ← actual' if t == target else ''}"
            for t, lp in zip(ids, lps)]
    return f"{label} top-{len(ids)}:\n" + "\n".join(rows)


def _colour(delta: float, scale: float) -> str:
    if math.isnan(delta):  # -inf on both sides: no change to show
        return ""
    r, g, b = _RED if delta < 0 else _BLUE
    return f"background: rgba({r},{g},{b},{0.85 * min(1.0, abs(delta) / scale):.3f})"


def _token_lines(rm: RecordMetrics, j: int, own: str, t: int, b: dict, n: dict, deltas: dict[int, float],
                 kl: dict[int, float], alt: dict[int, str], length: int) -> list[str]:
    """The title lines of one token: where it is, its text, both logprobs, the KL and both top-K lists."""
    head = f"record {rm.id}, position {j}: {json.dumps(own, ensure_ascii=False)} (id {t})"
    if j not in deltas:
        return [head, "not scored in both files"]
    bl, nl = b["token_logprobs"][j], n["token_logprobs"][j]
    lines = [head, f"baseline logprob {bl:.4f}, candidate {nl:.4f}, Δ {deltas[j]:+.4f}"]
    if not math.isnan(kl[j]):
        lines.append(f"KL(base ‖ new) {kl[j]:.4g}")
    for label, side in (("baseline", b), ("candidate", n)):
        lines.append(_top_lines(label, (side.get("top_ids") or [None] * length)[j],
                                (side.get("top_logprobs") or [None] * length)[j], t, alt))
    return lines


def _record_tokens(c: Comparison, row: int, rm: RecordMetrics, texts: Texts, scale: float) -> str:
    """One record's text as spans coloured by Δ logprob, both logprobs and top-K lists in the title; a span is one
    token, or the tokens of one character split across several (byte-level BPE), coloured by its largest |Δ|."""
    b = c.aligned.base.slice(row, 1).to_pylist()[0]
    n = c.aligned.new.slice(row, 1).to_pylist()[0]
    ids = b["token_ids"] or []
    pos = c.aligned.positions
    sel = pos.record == row
    kl = dict(zip(pos.position[sel].tolist(), pos.kld[sel].tolist()))
    deltas = {p: nl - bl for p, bl, nl in zip(pos.position[sel].tolist(), pos.base_lp[sel].tolist(),
                                                 pos.new_lp[sel].tolist())}
    start, stop = 0, len(ids)
    if len(ids) > MAX_TOKENS:  # a window around the largest change
        centre = max(deltas, key=lambda p: abs(deltas[p])) if deltas else 0
        start = min(max(0, centre - MAX_TOKENS // 2), len(ids) - MAX_TOKENS)
        stop = start + MAX_TOKENS
    tt = texts(ids[start:stop])
    top_ids = {t for side in (b, n) for top in (side.get("top_ids") or [])[start:stop] for t in top or []}
    alt = {t: texts([t]).pieces[0] for t in top_ids}  # alone: a partial character shows its bytes (<0xE8>)
    spans = []
    for s0, s1, text in tt.spans:
        js = range(start + s0, start + s1)
        blocks = [_token_lines(rm, j, tt.pieces[j - start], ids[j], b, n, deltas, kl, alt, len(ids)) for j in js]
        title = "\n\n".join("\n".join(lines) for lines in blocks)
        if len(js) > 1:
            title = f"{json.dumps(text, ensure_ascii=False)}: {len(js)} tokens (one character's bytes)\n\n{title}"
        scored = [deltas[j] for j in js if j in deltas]
        if not scored:
            spans.append(f'<span class="tok na" title="{_e(title)}">{_shown(text)}</span>')
            continue
        delta = max(scored, key=lambda d: -1.0 if math.isnan(d) else abs(d))
        spans.append(f'<span class="tok" style="{_colour(delta, scale)}" title="{_e(title)}">{_shown(text)}</span>')
    cut = ""
    if start or stop < len(ids):
        cut = (f'<p class="muted">tokens {start} to {stop - 1} of {len(ids)}, around the largest change '
               f"({start} before and {len(ids) - stop} after not shown)</p>")
    kld = f", mean KL {rm.mean_kld:.4g}, max KL {rm.max_kld:.4g}" if rm.mean_kld is not None else ""
    return (f'<div class="record" data-id="{_e(rm.id)}"><h3>{_e(rm.id)}</h3>'
            f'<p class="muted">{rm.num_positions} positions compared{kld}, ln PPL ratio {rm.ln_ppl_ratio:+.4g}, '
            f"max |Δ logprob| {rm.max_abs_logprob_diff:.4g}</p>{cut}"
            f'<div class="tokens">{"".join(spans)}</div></div>')


def _left_out(n: int, what: str) -> str:
    """The note under a table cut at MAX_TABLE_ROWS."""
    return (f'<p class="note">... and {n:,} more {what}, not listed: the page lists at most {MAX_TABLE_ROWS:,} '
            "(the JSON report, --report-json, has them all)</p>") if n > 0 else ""


def _worst_section(c: Comparison, worst: int, texts: Texts, budget: int) -> str:
    """The worst records' table and as many of them token by token as fit in `budget` bytes (in order)."""
    shown = c.records[:min(worst, MAX_TABLE_ROWS)]
    out = [f"<h2>Worst {len(shown)} records</h2>", _table(_WORST_HEAD, _worst_rows(c, len(shown)), table_id="worst"),
           _left_out(min(worst, len(c.records)) - len(shown), "of the worst records")]
    a = c.aligned
    if a is None or a.positions is None or "token_ids" not in a.base.column_names:
        return "\n".join(out + ['<p class="muted">no per-token data in the files: no token view</p>'])
    rows = {rid: i for i, rid in enumerate(a.base["id"].to_pylist())}
    delta = np.abs(a.positions.new_lp - a.positions.base_lp)[np.isin(a.positions.record, [rows[r.id] for r in shown])]
    # the largest finite |Δ| (an infinite one, from a -inf logprob, is drawn at full colour)
    scale = float(delta[np.isfinite(delta)].max(initial=0.0)) or 1e-12
    out.append(f'<div class="legend"><span>Δ logprob (candidate − baseline):</span><span>{-scale:.3g}</span>'
               f'<span class="bar"></span><span>+{scale:.3g}</span><span class="muted">grey: not scored; '
               "hover a token for its logprobs and top-K, click to pin them</span></div>")
    budget -= len("\n".join(out).encode()) + 1_000  # the note below
    views = []
    for r in shown:
        view = _record_tokens(c, rows[r.id], r, texts, scale)
        if len(view.encode()) > budget:
            out.append(f'<p class="note">{len(views)} of the {len(shown)} records are shown token by token: the '
                       f"next would take the page over {MAX_PAGE_BYTES / 1e6:g} MB (the table above lists all "
                       f"{len(shown)})</p>")
            break
        budget -= len(view.encode())
        views.append(view)
    return "\n".join(out + views)


# ---- The page ----


def to_html(c: Comparison, worst: int = 10, texts: Texts = id_texts, notes: list[str] | None = None) -> str:
    """The comparison as a self-contained HTML page; `texts` turns token ids into their texts (io/token_text.py),
    `notes` are shown beside the comparison's own."""
    verdict_text = verdict(c.checks)
    cls = "none" if not c.checks else "pass" if c.passed else "fail"
    parts = [f'<h1>apcscore compare: <span class="verdict {cls}" id="verdict">{_e(verdict_text)}</span></h1>',
             f'<p class="muted">baseline {_e(c.base.path)} ({_e(c.base.model or "-")}, {_e(c.base.dtype or "-")}) · '
             f'candidate {_e(c.new.path)} ({_e(c.new.model or "-")}, {_e(c.new.dtype or "-")})</p>']
    if c.checks:
        parts += ["<h2>Thresholds</h2>", _table(CHECK_HEAD, check_rows(c.checks), ["pass" if ch.passed else "fail"
                                                                                 for ch in c.checks], "thresholds")]
    else:
        parts.append('<p class="muted">no thresholds given: nothing was judged</p>')
    same = differ_line(c)
    parts += [f'<p class="muted" id="differ">{_e(same)}</p>' if same else
              "<h2>Runs differ in</h2>" + _table(DIFFER_HEAD, _differ_rows(c), table_id="differ")]
    parts += ["<h2>Metrics</h2>", _table(("metric", "baseline", "candidate", "change"), _metric_rows(c),
                                         table_id="metrics")]
    for title, head, rows in _extra_tables(c):  # KL and delta p blocks, paired statistics
        parts += [f"<h3>{_e(title.replace('||', '‖'))}</h3>", _table(head, rows)]
    all_notes = [*c.notes, *(notes or [])]
    if all_notes:
        parts.append("<ul>" + "".join(f'<li class="note">note: {_e(n)}</li>' for n in all_notes) + "</ul>")
    figs = _figures(c)
    parts += ["<h2>Per-token figures</h2>", _plot_divs(figs) if figs else
              '<p class="muted">no position was scored in both files: no charts</p>']
    worst_at = len(parts)  # filled last: its token views take the bytes the rest leaves
    parts.append("<h2>Multiple-choice flips</h2>")
    if c.flips:
        flips = c.flips[:MAX_TABLE_ROWS]
        classes = ["worse" if f.correct_base and not f.correct_new else "better" if f.correct_new and not
                   f.correct_base else "" for f in flips]
        parts += [_table(_FLIP_HEAD, _flip_rows(c)[:MAX_TABLE_ROWS], classes, "flips"),
                  _left_out(len(c.flips) - len(flips), "flips")]
    else:
        none = "no prediction flipped" if c.metrics.num_choice_records else "no multiple-choice records"
        parts.append(f'<p class="muted">{none}</p>')
    for title, head, rows, what in (
            ("Excluded records (status 'error')", EXCLUDED_HEAD, _excluded_rows(c), "excluded records"),
            ("Records left out (--common-records)", LEFT_OUT_HEAD, _left_out_rows(c), "records left out")):
        if rows:
            parts += [f"<h2>{title}</h2>", _table(head, rows[:MAX_TABLE_ROWS]),
                      _left_out(len(rows) - MAX_TABLE_ROWS, what)]
    parts += ["<h2>Compared runs</h2>", _table(("", "baseline", "candidate"), _sides(c))]
    aside = ('<aside><h3>Pinned token</h3><pre id="pin-text" class="muted">click a token of a record to pin its '
             "logprobs and top-K here</pre></aside>")
    head = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>apcscore compare: {_e(verdict_text)}</title><style>{CSS}</style>"
            f'<script type="text/javascript">{get_plotlyjs()}</script></head>\n<body><main>')
    tail = f"</main>{aside}<script>{JS}</script></body></html>\n"
    if c.records and worst:
        used = sum(len(x.encode()) for x in (head, tail, *parts))
        parts.insert(worst_at, _worst_section(c, worst, texts, MAX_PAGE_BYTES - used))
    return head + "".join(parts) + tail
