"""The style sheet and the script of `compare --report-html` (apcscore.compare.html_report), kept apart from the
code that writes the page."""

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1f2328; }
main { margin: 0 360px 0 0; padding: 16px 28px 48px; }
h1 { font-size: 22px; margin: 8px 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #d0d7de; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.verdict { padding: 2px 10px; border-radius: 6px; color: white; }
.verdict.pass { background: #1a7f37; } .verdict.fail { background: #cf222e; } .verdict.none { background: #9a6700; }
table { border-collapse: collapse; margin: 6px 0 10px; font-size: 13px; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.pass td:last-child { color: #1a7f37; font-weight: 600; } tr.fail td:last-child { color: #cf222e; font-weight: 600; }
tr.worse { background: #ffebe9; } tr.better { background: #dafbe1; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; } .plot { width: 460px; height: 360px; border: 1px solid #d0d7de; }
.tokens { font: 13px/1.9 ui-monospace, SFMono-Regular, Menlo, monospace; white-space: pre-wrap; word-break: break-all;
          border: 1px solid #d0d7de; padding: 8px; background: #fff; }
.tok { cursor: pointer; border-radius: 2px; } .tok:hover, .tok.pinned { outline: 2px solid #0969da; }
.tok.na { color: #8c959f; }
.legend { display: flex; align-items: center; gap: 8px; font-size: 12px; margin: 4px 0; }
.legend .bar { width: 240px; height: 12px; border: 1px solid #d0d7de;
  background: linear-gradient(to right, rgba(220,38,38,.85), white, rgba(37,99,235,.85)); }
.note { color: #9a6700; } .muted { color: #57606a; }
aside { position: fixed; top: 0; right: 0; width: 340px; height: 100vh; overflow: auto; box-sizing: border-box;
        padding: 16px; border-left: 1px solid #d0d7de; background: #f6f8fa; }
aside pre { white-space: pre-wrap; overflow-wrap: anywhere; font: 12px/1.5 ui-monospace, Menlo, monospace; }
"""

# A click on a token pins its details (its title) in the side panel.
JS = """
document.addEventListener("click", function (e) {
  var t = e.target.closest ? e.target.closest(".tok") : null;
  if (!t) return;
  var old = document.querySelector(".tok.pinned");
  if (old) old.classList.remove("pinned");
  t.classList.add("pinned");
  document.getElementById("pin-text").textContent = t.getAttribute("title");
});
"""
