"""The evidence behind `apcscore compare`'s default gate: harmless and damaging changes of the default model,
scored on one varied dataset and compared against the unchanged model (docs/compare.md, "The default gate").

    .venv/bin/python scripts/compare_evidence.py                 # every candidate, K = 5 (~12 min on 2 quiet cores)
    .venv/bin/python scripts/compare_evidence.py --top-k 20 --candidates bf16,mlp_zeroed

The dataset is built here, deterministically, from the repository's sample datasets (Shakespeare chunks, the
hand-written prompts, continuations and 40 multiple-choice questions), Python standard-library source (code),
sentences in 20 languages and chat-formatted turns (`--dataset-out` keeps it). Every candidate is a Hugging Face
folder derived from the default model's fp32 weights (the dequantized copy `apcscore` caches), or the same weights
run another way (another dtype, one thread). Each is scored with the real CLI (`apcscore score --prompt-logprobs K`)
and compared with `compare_files` and the default thresholds; the script prints a Markdown table of each
candidate's figures (point estimates and the one-sided 95% bounds the gate judges) and its default verdict.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from apcscore.compare.gate import compare_files  # noqa: E402
from apcscore.compare.thresholds import Thresholds  # noqa: E402
from apcscore.models.locate import resolve_model  # noqa: E402

# One sentence in each of 20 languages (written for this project): scripts that byte-level BPE splits.
LANGUAGES = [
    ("cs", "Praha je hlavní město České republiky a leží na řece Vltavě."),
    ("de", "Die Hauptstadt von Deutschland ist Berlin, und sie liegt an der Spree."),
    ("fr", "La capitale de la France est Paris ; la ville est traversée par la Seine."),
    ("es", "La capital de España es Madrid, una ciudad situada en el centro del país."),
    ("it", "La capitale d'Italia è Roma, che è attraversata dal fiume Tevere."),
    ("pt", "A capital de Portugal é Lisboa, às margens do rio Tejo."),
    ("nl", "De hoofdstad van Nederland is Amsterdam, bekend om zijn grachten."),
    ("pl", "Stolicą Polski jest Warszawa, która leży nad Wisłą."),
    ("sv", "Sveriges huvudstad är Stockholm, som är byggd på fjorton öar."),
    ("fi", "Suomen pääkaupunki on Helsinki, joka sijaitsee Suomenlahden rannalla."),
    ("tr", "Türkiye'nin başkenti Ankara'dır; en kalabalık şehri ise İstanbul'dur."),
    ("ru", "Столица России — Москва, крупнейший город страны."),
    ("uk", "Столиця України — Київ, місто на річці Дніпро."),
    ("el", "Η πρωτεύουσα της Ελλάδας είναι η Αθήνα."),
    ("ar", "عاصمة مصر هي القاهرة، وتقع على نهر النيل."),
    ("hi", "भारत की राजधानी नई दिल्ली है, जो यमुना नदी के पास स्थित है।"),
    ("zh", "中国的首都是北京，它是一座历史悠久的城市。"),
    ("ja", "日本の首都は東京で、世界最大級の都市の一つです。"),
    ("ko", "대한민국의 수도는 서울이며 한강이 도시를 가로지릅니다."),
    ("vi", "Thủ đô của Việt Nam là Hà Nội, nằm bên bờ sông Hồng."),
]

CHATS = [
    ("How do I reverse a list in Python?", "Use `my_list.reverse()` to reverse it in place, or `my_list[::-1]` "
     "to get a reversed copy."),
    ("What is the boiling point of water?", "At sea level, water boils at 100 degrees Celsius (212 °F)."),
    ("Give me a synonym for happy.", "Some synonyms for happy are joyful, cheerful and content."),
    ("Translate 'good morning' into Spanish.", "'Good morning' in Spanish is 'buenos días'."),
    ("What is 12 times 11?", "12 times 11 is 132."),
]

# standard-library functions whose source is a code record (the text follows this Python's version)
CODE = ["textwrap.TextWrapper._wrap_chunks", "json.decoder.py_scanstring", "heapq._siftup", "shlex.quote",
        "fnmatch.translate", "statistics.median", "colorsys.rgb_to_hls", "string.capwords", "calendar.isleap",
        "glob.has_magic", "difflib.SequenceMatcher.ratio", "email.utils.quote", "urllib.parse.urlsplit",
        "csv.Sniffer._guess_delimiter", "argparse.HelpFormatter._split_lines"]


def _read(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "datasets" / name).read_text(encoding="utf-8").splitlines()
            if line.strip()]


def _resolve(dotted: str):
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def build_dataset() -> list[dict]:
    """The evidence records, in a fixed order (~150 records, ~14k tokens)."""
    records: list[dict] = []
    for text in _read("sample_texts.jsonl"):  # prose: the Shakespeare texts in chunks of 12 lines
        lines = [line for line in text["text"].splitlines() if line.strip()]
        for i in range(0, min(len(lines), 12 * 12), 12):
            records.append({"id": f"{text['id']}_{i // 12:02d}", "prompt": "\n".join(lines[i:i + 12])})
    records += [{**r, "id": f"prompt_{r['id']}"} for r in _read("sample_prompts.jsonl")]
    records += [{"id": f"code_{name}", "prompt": inspect.getsource(_resolve(name))[:1500]} for name in CODE]
    records += [{"id": f"lang_{code}", "prompt": text} for code, text in LANGUAGES]
    records += [{"id": f"chat_{i}", "prompt": f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>"}
                for i, (q, a) in enumerate(CHATS)]
    records += [{**r, "id": f"cont_{r['id']}"} for r in _read("sample_continuations.jsonl")]
    records += [{**r, "id": f"mc_{r['id']}"} for r in _read("sample_choices.jsonl")]
    return records


# ----------------------------------------------------------------------------------------------------------
# Candidates: a change of the weights (a function of the state dict) or of how the same weights run
# ----------------------------------------------------------------------------------------------------------

Weights = dict[str, torch.Tensor]


def _round_trip(dtype: torch.dtype) -> Callable[[Weights], Weights]:
    return lambda w: {k: v.to(dtype).to(v.dtype) for k, v in w.items()}


def _quantize(bits: int, group: int | None) -> Callable[[Weights], Weights]:
    """Symmetric round-to-nearest weight-only quantization of every 2-D projection (not embeddings or norms),
    per output channel (group None) or per group of `group` input columns."""
    qmax = 2 ** (bits - 1) - 1

    def apply(w: Weights) -> Weights:
        out = {}
        for k, v in w.items():
            if v.dim() != 2 or "embed" in k or "lm_head" in k:
                out[k] = v
                continue
            g = v.reshape(v.shape[0], -1, group) if group else v.unsqueeze(1)  # [out, groups, in/groups]
            scale = g.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / qmax
            out[k] = ((g / scale).round().clamp(-qmax - 1, qmax) * scale).reshape(v.shape)
        return out

    return apply


def _noise(rel: float) -> Callable[[Weights], Weights]:
    """Gaussian noise of `rel` times each projection's standard deviation (seeded)."""

    def apply(w: Weights) -> Weights:
        gen = torch.Generator().manual_seed(0)
        return {k: v + rel * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2 and "embed" not in k
                else v for k, v in w.items()}

    return apply


def _zero(layer: int, part: str) -> Callable[[Weights], Weights]:
    return lambda w: {k: torch.zeros_like(v) if k == f"model.layers.{layer}.{part}.weight" else v
                      for k, v in w.items()}


# name -> (expected: "pass" | "fail", what it is, weights change or None, extra score options, extra environment)
CANDIDATES: dict[str, tuple[str, str, Callable[[Weights], Weights] | None, list[str], dict[str, str]]] = {
    "copy": ("pass", "exact copy of the weights", lambda w: w, [], {}),
    "threads1": ("pass", "same weights, 1 thread", None, [], {"OMP_NUM_THREADS": "1"}),
    "bf16_weights": ("pass", "bf16 round trip of the weights", _round_trip(torch.bfloat16), [], {}),
    "fp16_weights": ("pass", "fp16 round trip of the weights", _round_trip(torch.float16), [], {}),
    "bf16_compute": ("pass", "same weights run in bfloat16", None, ["--dtype", "bfloat16"], {}),
    "int8": ("pass", "int8 per-channel weight-only (RTN)", _quantize(8, None), [], {}),
    "int4_g32": ("fail", "int4 weight-only, groups of 32 (RTN)", _quantize(4, 32), [], {}),
    "int4": ("fail", "int4 per-channel weight-only (RTN)", _quantize(4, None), [], {}),
    "noise_1pct": ("pass", "1% Gaussian weight noise (about int8's error)", _noise(0.01), [], {}),
    "noise_2pct": ("fail", "2% Gaussian weight noise", _noise(0.02), [], {}),
    "noise_5pct": ("fail", "5% Gaussian weight noise", _noise(0.05), [], {}),
    "mlp_zeroed": ("fail", "layer 15's MLP down projection zeroed", _zero(15, "mlp.down_proj"), [], {}),
    "attn_out_zeroed": ("fail", "layer 15's attention output projection zeroed", _zero(15, "self_attn.o_proj"),
                        [], {}),
}


def write_folder(base: Path, dest: Path, change: Callable[[Weights], Weights]) -> None:
    """A Hugging Face folder: the base folder's files, with its weights passed through `change`."""
    dest.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.startswith(".") \
                and f.name != "apcscore-cache.json":
            shutil.copy2(f, dest / f.name)
    weights = load_file(base / "model.safetensors")
    save_file({k: v.contiguous() for k, v in change(weights).items()}, dest / "model.safetensors",
              metadata={"format": "pt"})


def score(model: Path, data: Path, out: Path, top_k: int, extra: list[str], env: dict[str, str]) -> float:
    cmd = [sys.executable, "-m", "apcscore", "score", str(data), "--model", str(model), "--prompt-logprobs",
           str(top_k), "--out", str(out), "--overwrite", "--quiet", *extra]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    return time.perf_counter() - start


def _fmt(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--candidates", default=",".join(CANDIDATES),
                    help="comma-separated names: " + ", ".join(CANDIDATES))
    ap.add_argument("--work", type=Path, help="keep the folders and result files here (default: a temporary folder)")
    ap.add_argument("--dataset-out", type=Path, help="also write the evidence dataset here")
    ap.add_argument("--json-out", type=Path, help="also write every candidate's figures as JSON here")
    ap.add_argument("--score-only", action="store_true", help="score the candidates into --work, compare nothing")
    args = ap.parse_args()
    names = [n for n in args.candidates.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        ap.error(f"unknown candidate(s) {unknown}; known: {', '.join(CANDIDATES)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="apcscore-evidence-"))
    work.mkdir(parents=True, exist_ok=True)
    records = build_dataset()
    data = work / "evidence.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    if args.dataset_out:
        shutil.copy2(data, args.dataset_out)
    base_model = resolve_model("smollm2-135m")[0]
    base_out = work / f"base-k{args.top_k}.parquet"
    if not base_out.exists():
        secs = score(base_model, data, base_out, args.top_k, [], {})
        print(f"baseline scored in {secs:.0f} s ({len(records)} records)", file=sys.stderr)
    rows, dump = [], {}
    for name in names:
        expected, what, change, extra, env = CANDIDATES[name]
        model = base_model
        if change is not None:
            model = work / f"model-{name}"
            if not model.exists():
                write_folder(base_model, model, change)
        out = work / f"{name}-k{args.top_k}.parquet"
        if not out.exists():
            secs = score(model, data, out, args.top_k, extra, env)
            print(f"{name}: scored in {secs:.0f} s", file=sys.stderr)
        if args.score_only:
            continue
        c = compare_files(base_out, out, Thresholds.defaults())
        strict = compare_files(base_out, out, Thresholds.defaults().override(Thresholds(decision="strict"))).passed
        m = c.metrics
        verdict = "PASS" if c.passed else "FAIL"
        failed = ", ".join(ch.option for ch in c.checks if not ch.passed)
        rows.append(f"| {name} | {what} | {_fmt(m.ppl_ratio, 5)} | {_fmt(m.kld.mean if m.kld else None)} | "
                    f"{_fmt(m.kld.percentiles['99'] if m.kld else None)} | {_fmt(m.top1_agreement, 4)} | "
                    f"{_fmt(m.accuracy_base)} → {_fmt(m.accuracy_new)} | {verdict}{f' ({failed})' if failed else ''} "
                    f"| {'PASS' if strict else 'FAIL'} | {expected.upper()} |")
        dump[name] = {"expected": expected, "passed": c.passed, "checks": [ch.__dict__ for ch in c.checks],
                      "ppl_ratio": m.ppl_ratio, "mean_kld": m.kld.mean if m.kld else None,
                      "top1_agreement": m.top1_agreement, "accuracy_base": m.accuracy_base,
                      "accuracy_new": m.accuracy_new}
    print(f"\n{len(records)} records, K = {args.top_k}; baseline: the default model's fp32 weights\n")
    print("| candidate | change | PPL ratio | mean KL (K bound) | p99 KL | top-1 | accuracy | default verdict | "
          "--decision strict | expected |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json_out:
        args.json_out.write_text(json.dumps(dump, indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
