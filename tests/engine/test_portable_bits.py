"""Portable bits (issue 39): a result's bits are the same on every CPU, whatever its vector width, vendor or thread
count (docs/architecture.md, "Portable bits").

- The portable math (apcscore.kernels.cpu_math) gives the same bits in every copy this CPU runs (baseline, AVX2,
  AVX-512) and with 1 or 2 threads, on random and special inputs; and it is accurate (stated bounds against float64).
- Whole runs, in subprocesses under every combination the suite can force here: torch's vector code
  (ATEN_CPU_CAPABILITY default / avx2 / avx512), ours (APCSCORE_SIMD scalar / avx2 / avx512) and the threads
  (OMP_NUM_THREADS 1 / 2). The default model's runs must give the committed golden digests
  (tests/golden_digests.json: scripts/golden_digests.py); every tiny native family the same digests in each setting.
  CI lands on Intel and AMD machines at random, so the golden test is also the cross-vendor check.
"""

from __future__ import annotations

from typing import Iterator

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from apcscore.kernels import cpu_math, rowmath
from apcscore.kernels.cpu_library import SIMD_SETTINGS, library

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden_digests.json"
SCRIPT = ROOT / "scripts" / "golden_digests.py"
# (ATEN_CPU_CAPABILITY, APCSCORE_SIMD, OMP_NUM_THREADS) of the subprocess runs: each level of both, both thread counts
SETTINGS = [("default", "scalar", "1"), ("avx2", "avx2", "2"), ("avx512", "avx512", "1")]
# the default model's runs per setting: the scalar GEMM (fmaf one element at a time) is slow, so there only fp32
# scoring (~80 s on 2 cores); the vector settings also sample, and run bf16. score-reference
# (~160 s under scalar: two forwards) adds no kernel there: its forwards are score's GEMM and logprob path (other
# weights for the int8 copy), its KL our double exp and log (compared across SIMD levels and threads in process:
# test_the_exact_divergence_gives_the_same_bits_...) and torch's elementwise IEEE operations (exact under any ATen
# level); the golden test runs it.
DEFAULT_MODEL_RUNS = {"scalar": ["--runs", "score", "--dtypes", "float32"],
                      "avx2": ["--runs", "score,generate-sampled"], "avx512": ["--runs", "score,generate-sampled"]}
NATIVE_TINY = ["llama", "llama3", "mistral", "qwen2", "qwen3", "neox", "olmo2", "phi3", "phi3_longrope",
               "phi3_partial", "mixtral", "qwen2_moe", "gemma2", "gemma3"]

pytestmark = pytest.mark.skipif(not rowmath.portable(), reason="the portable CPU math needs a C compiler")


def levels() -> list[str]:
    """The SIMD settings this CPU can run (scalar always)."""
    best = library().apc_math_level()
    return [name for name, level in SIMD_SETTINGS.items() if level <= best]


def each_setting(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    """Every (SIMD setting, thread count 1 and 2) this CPU can run, each set while its iteration runs; the thread
    count is restored afterwards."""
    threads = torch.get_num_threads()
    try:
        for level in levels():
            for n in (1, 2):
                monkeypatch.setenv("APCSCORE_SIMD", level)
                torch.set_num_threads(n)
                yield level, n
    finally:
        torch.set_num_threads(threads)


def inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.7, 88.8, -87.3, -103.9, -104.5,
                             1e-30, -1e-30, 1.4e-45, 0.4999, 0.5, 0.5001, 9.0, -9.0, 20.0])
    return torch.cat([specials, torch.randn(100_003, generator=g) * 4, torch.linspace(-110, 95, 20_011)])


FUNCTIONS = {
    "exp": rowmath.exp, "tanh": rowmath.tanh, "silu": rowmath.silu, "sigmoid": rowmath.sigmoid,
    "gelu_tanh": lambda x: rowmath.gelu(x, "tanh"), "gelu": rowmath.gelu,
    "row_sum": lambda x: rowmath.row_sum(x.view(-1, 61)[:, :57]),
    "row_logsumexp": lambda x: rowmath.row_logsumexp(x.view(-1, 61)),
    "rms_norm": lambda x: rowmath.rms_norm(x.view(-1, 61), torch.ones(61), 1e-5),
    "layer_norm": lambda x: rowmath.layer_norm(x.view(-1, 61), torch.ones(61), torch.zeros(61), 1e-5),
    "softmax": lambda x: rowmath.softmax(x.view(-1, 61)),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64 if t.dtype == torch.float64 else torch.int32)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_every_simd_level_and_thread_count_gives_the_same_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x = inputs()[:120_011 // 61 * 61]
    if name in ("rms_norm", "layer_norm", "softmax", "row_logsumexp"):
        x = torch.nan_to_num(x, nan=1.0, posinf=50.0, neginf=-50.0)
    results = {setting: bits(FUNCTIONS[name](x.clone())) for setting in each_setting(monkeypatch)}
    first = next(iter(results.values()))
    assert all(torch.equal(first, r) for r in results.values()), [k for k, r in results.items()
                                                                    if not torch.equal(first, r)]


def test_the_exact_divergence_gives_the_same_bits_in_every_simd_level_and_thread_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """score --reference-model's KL, reference logprob, delta p and top-1 columns (kernels/divergence_torch) of
    rows over the default model's vocabulary (so 2 threads split the double exps): one set of bits."""
    from apcscore.kernels.divergence_torch import row_divergence

    g = torch.Generator().manual_seed(0)
    logits, ref_logits = (torch.randn(8, 49152, generator=g) * 5 for _ in range(2))
    logits[3, :100] = ref_logits[3, :100] = -float("inf")  # tokens that both give probability 0
    targets = torch.randint(0, 49152, (8,), generator=g)
    results = {setting: [t.contiguous().view(torch.uint8) for t in row_divergence(logits, ref_logits, targets)]
               for setting in each_setting(monkeypatch)}
    first = next(iter(results.values()))
    for setting, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(first, got)), setting


def ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of got's last place (fp32 got, fp64 exact), over finite normal results."""
    keep = torch.isfinite(exact) & (exact.abs() > 1.2e-38) & (exact.abs() < 3e38)
    got, exact = got[keep], exact[keep]
    ulp = (torch.nextafter(got, torch.full_like(got, math.inf)) - got).double()
    return (got.double() - exact).abs() / ulp


def test_accuracy_against_float64() -> None:
    """Bounds stated here and in docs/architecture.md: exp 1 ulp, tanh / sigmoid / silu 2.5 ulp, logsumexp 2e-8
    absolute (float exps, double sums and log: a logprob's fp32 rounding is coarser), the double functions within
    4e-16 of CPython's libm (correctly rounded or nearly; erf within 1e-10: its series cancels near |x| = 4, and it
    only feeds a float GELU), sin / cos also at large arguments (rotary angles up to 1e5)."""
    x = inputs()
    x = x[torch.isfinite(x)]
    d = x.double()
    assert ulps(rowmath.exp(x), d.exp()).max() <= 1.0
    assert ulps(rowmath.tanh(x), d.tanh()).max() <= 2.5
    # silu is torch's formula x / (1 + exp(-x)): below x = -88.7 exp(-x) overflows and the result is -0, as torch's
    m = x.abs() < 80
    assert ulps(rowmath.sigmoid(x[m]), torch.sigmoid(d[m])).max() <= 2.5
    assert ulps(rowmath.silu(x[m]), d[m] * torch.sigmoid(d[m])).max() <= 2.5
    rows = (torch.randn(64, 4099, generator=torch.Generator().manual_seed(1)) * 6)
    lse = rowmath.row_logsumexp(rows)
    assert (lse - torch.logsumexp(rows.double(), -1)).abs().max() < 2e-8  # float exps (1 ulp), double sum and log
    for fn, ref, args in [(cpu_math.D_EXP, math.exp, [-700, -1.5, 0.0, 1e-8, 0.693, 50.0, 700]),
                          (cpu_math.D_LOG, math.log, [1e-300, 0.1, 0.999, 1.0, 2.0, 1e10, 1e300]),
                          (cpu_math.D_SIN, math.sin, [0.0, 1e-9, 0.7, 1.5707963, 3.14159, 100.0, 8191.5, 99999.25]),
                          (cpu_math.D_COS, math.cos, [0.0, 1e-9, 0.7, 1.5707963, 3.14159, 100.0, 8191.5, 99999.25]),
                          (cpu_math.D_ERF, math.erf, [-3.9, -1.0, -1e-5, 0.0, 0.3, 1.0, 2.5, 3.99])]:
        for v in args:
            got, want = cpu_math.scalar(fn, v), ref(v)
            assert got == want or abs(got - want) <= 4e-16 * abs(want) + (1e-10 if fn == cpu_math.D_ERF else 0), \
                (fn, v, got, want)


def test_special_values() -> None:
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 89.0, -105.0])
    e = rowmath.exp(x)
    assert e[:4].tolist() == [1.0, 1.0, float("inf"), 0.0] and math.isnan(e[4]) and e[5] == math.inf and e[6] == 0
    t = rowmath.tanh(x)
    assert t[:4].tolist() == [0.0, -0.0, 1.0, -1.0] and math.copysign(1, t[1]) == -1 and math.isnan(t[4])
    assert rowmath.row_logsumexp(torch.full((2, 5), -float("inf"))).tolist() == [-math.inf, -math.inf]
    assert math.isnan(rowmath.row_logsumexp(torch.tensor([[0.0, float("nan")]]))[0])
    assert rowmath.exp_scalar(0.0) == 1.0 and rowmath.log_scalar(1.0) == 0.0


def setting_env(setting: tuple[str, str, str]) -> dict[str, str]:
    """The environment of a subprocess run under `setting` (ATEN_CPU_CAPABILITY, APCSCORE_SIMD, OMP_NUM_THREADS)."""
    capability, simd, threads = setting
    return {**os.environ, "ATEN_CPU_CAPABILITY": capability, "APCSCORE_SIMD": simd, "OMP_NUM_THREADS": threads}


class DigestRuns:
    """The subprocess runs of scripts/golden_digests.py (a setting, its arguments) this module's selected tests
    read, queued in test order and run side by side, as many at once as this machine has CPUs: a run forced to 1
    thread (the scalar setting's, ~80 s for the default model) would otherwise leave the second of CI's 2 cores
    idle while its test waits. A run's bits do not depend on what else runs (its setting is forced)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.queued: dict[tuple, list[str]] = {}  # (setting, arguments) -> its command line
        self.started: dict[tuple, tuple[subprocess.Popen, Path]] = {}
        self.at_once = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def queue(self, setting: tuple[str, str, str], extra: list[str]) -> None:
        self.queued.setdefault((setting, tuple(extra)), extra)

    def _start(self, key: tuple) -> None:
        setting, extra = key[0], self.queued.pop(key)
        out = self.folder / f"{len(self.started)}-{'-'.join(setting)}.json"
        with out.with_suffix(".stderr").open("w") as stderr:  # a file, not a pipe: nothing waits for a reader
            proc = subprocess.Popen([sys.executable, str(SCRIPT), "--write", str(out), *extra],
                                    env=setting_env(setting), stdout=subprocess.DEVNULL, stderr=stderr)
        self.started[key] = proc, out

    def fill(self) -> None:
        """Start queued runs while fewer than `at_once` run."""
        running = sum(proc.poll() is None for proc, _ in self.started.values())
        for key in list(self.queued)[:max(0, self.at_once - running)]:
            self._start(key)

    def result(self, setting: tuple[str, str, str], extra: list[str]) -> dict:
        """The run's digests, once it has ended; queued runs start as running ones end meanwhile."""
        key = (setting, tuple(extra))
        if key not in self.started:
            self.queue(setting, extra)
            self._start(key)
        proc, out = self.started[key]
        deadline = time.monotonic() + 1800
        while proc.poll() is None:
            self.fill()
            assert time.monotonic() < deadline, f"{setting} {extra}: over 1800 s"
            time.sleep(0.2)
        assert proc.returncode == 0, out.with_suffix(".stderr").read_text()[-3000:]
        return json.loads(out.read_text())

    def close(self) -> None:
        for proc, _ in self.started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def supported(settings: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The settings this CPU can run (AVX-512 ones only where it has AVX-512)."""
    return [s for s in settings if s[1] in levels()]


# what a setting's subprocess must see: torch's capability; our GEMM's micro-kernel and the row math's cap
CAPABILITY_SEEN = {"default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}
KERNEL_SEEN = {"scalar": ["scalar-fma", "0"], "avx2": ["avx2-fma", "1"], "avx512": ["avx512-fma", "2"]}
PROBE = ("import torch; from apcscore.kernels.cpu_gemm import simd_level; from apcscore.kernels.cpu_library import "
         "forced_simd; print(torch.backends.cpu.get_cpu_capability(), simd_level(), forced_simd(), "
         "torch.get_num_threads())")


@pytest.mark.slow
@pytest.mark.parametrize("setting", supported(SETTINGS), ids="-".join)
def test_the_forced_settings_take_effect(setting: tuple[str, str, str]) -> None:
    """The settings the cross-setting tests below force reach torch and our kernels: were one ignored (a renamed
    variable, a torch that drops ATEN_CPU_CAPABILITY), those tests would compare a setting with itself and pass."""
    res = subprocess.run([sys.executable, "-c", PROBE], env=setting_env(setting), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    capability, simd, threads = setting
    assert res.stdout.split() == [CAPABILITY_SEEN[capability], *KERNEL_SEEN[simd], threads], (setting, res.stdout)


def as_it_is() -> tuple[str, str, str]:
    """The setting of the golden run: this machine as it is (nothing forced but the thread count it has)."""
    return "", "", str(torch.get_num_threads())


def tiny_families_runs(tiny_model_dir) -> list[str]:
    """The golden_digests arguments of the tiny families' runs."""
    return [*(arg for arch in NATIVE_TINY for arg in ("--model", str(tiny_model_dir(arch)))), "--runs",
            "generate-scored"]


@pytest.fixture(scope="module")
def digest_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DigestRuns]:
    """The module's DigestRuns: every run its selected tests read, queued in their order, the first ones started
    (while the tiny models are built, where their test is selected)."""
    runs = DigestRuns(tmp_path_factory.mktemp("digests"))
    names = []
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        names.append(item.originalname)
        if item.originalname == "test_default_model_gives_the_golden_digests":
            runs.queue(as_it_is(), [])
        elif item.originalname == "test_default_model_bits_do_not_depend_on_the_instruction_set":
            setting = item.callspec.params["setting"]
            runs.queue(setting, DEFAULT_MODEL_RUNS[setting[1]])
    runs.fill()
    if "test_tiny_families_bits_do_not_depend_on_the_instruction_set" in names:
        for setting in supported(SETTINGS):
            runs.queue(setting, tiny_families_runs(request.getfixturevalue("tiny_model_dir")))
        runs.fill()
    yield runs
    runs.close()


@pytest.mark.slow
def test_default_model_gives_the_golden_digests(digest_runs: DigestRuns) -> None:
    """Score, multiple choice, perplexity, greedy and seeded-sampled generation of the default model, fp32 and bf16,
    on this machine as it is: the committed digests."""
    got = digest_runs.result(as_it_is(), [])
    want = json.loads(GOLDEN.read_text())
    assert got == want, f"differing: {[k for k in want if got.get(k) != want[k]]}"


@pytest.mark.slow
@pytest.mark.parametrize("setting", supported(SETTINGS), ids="-".join)
def test_default_model_bits_do_not_depend_on_the_instruction_set(setting: tuple[str, str, str],
                                                                 digest_runs: DigestRuns) -> None:
    """Scoring and seeded sampling of the default model under forced instruction sets and thread counts: the
    golden digests (DEFAULT_MODEL_RUNS says which runs each setting makes)."""
    got = digest_runs.result(setting, DEFAULT_MODEL_RUNS[setting[1]])
    want = json.loads(GOLDEN.read_text())
    assert got == {k: want[k] for k in got}, f"differing: {[k for k in got if got[k] != want[k]]}"


@pytest.mark.slow
def test_tiny_families_bits_do_not_depend_on_the_instruction_set(tiny_model_dir, digest_runs: DigestRuns) -> None:
    """Every native tiny family: seeded sampling with the prompts' top-5 logprobs (the scored prefill, decode and the
    sampler in one run), fp32 and bf16, gives one set of digests under every setting."""
    runs = {setting: digest_runs.result(setting, tiny_families_runs(tiny_model_dir))
            for setting in supported(SETTINGS)}
    first = next(iter(runs.values()))
    for setting, digests in runs.items():
        assert digests == first, (setting, [k for k in first if digests.get(k) != first[k]])


# The subprocess runs above score prompts shorter than one 64-key tile; these families' attention across tiles: plain
# causal (Llama), soft-capped with a window inside a tile (Gemma 2: 24), a window across a tile (Gemma 3: 70). The
# row ops do not depend on the length (one row at a time): the short runs reach them already.
TILE_FAMILIES = ["llama", "gemma2", "gemma3"]
IN_PROCESS = [("scalar", 1), ("avx2", 2), ("avx512", 1)]  # APCSCORE_SIMD, torch threads (ATen's level is fixed here)


def golden_digest(path: Path) -> str:
    """scripts/golden_digests.digest: SHA-256 of a result file's bit columns (every float's exact hex form)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("golden_digests", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digest(path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", TILE_FAMILIES)
def test_perplexity_and_greedy_generation_across_tiles_do_not_depend_on_the_simd_level(
        arch: str, tiny_model_dir, write_jsonl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Perplexity of a 282-token text (windows of 160: three key tiles) and greedy generation of 16 tokens after a
    190-token prompt (prefill and decode over three tiles, the prompt's logprobs too) of tiny native families, fp32
    and bf16: the same digests under each of our kernels' levels and 1 or 2 threads (in process: ATen's capability
    cannot change once torch is loaded; the subprocess tests above vary it)."""
    from typer.testing import CliRunner

    from apcscore.cli import app

    text = json.loads((ROOT / "datasets" / "sample_texts.jsonl").read_text().splitlines()[0])["text"][:900]
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"id": "t", "text": text}])
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "p", "prompt": text[:600]}])
    runs = {"perplexity": ["perplexity", str(texts), "--window", "160", "--stride", "80"],
            "greedy": ["generate", str(prompts), "--max-tokens", "16", "--logprobs", "3", "--prompt-logprobs", "2"]}
    model, threads_before, digests = str(tiny_model_dir(arch)), torch.get_num_threads(), {}
    try:
        for simd, threads in [s for s in IN_PROCESS if s[0] in levels()]:
            monkeypatch.setenv("APCSCORE_SIMD", simd)
            torch.set_num_threads(threads)
            for name, args in runs.items():
                for dtype in ("float32", "bfloat16"):
                    out = tmp_path / f"{simd}-{threads}-{name}-{dtype}.parquet"
                    # 64 KV blocks hold either run (<= 3 windows of 160 tokens, or 206 tokens) and spare each load
                    # the seconds a pool sized from free memory (a million tiny blocks) takes to set up
                    res = CliRunner().invoke(app, [*args, "--model", model, "--dtype", dtype, "--out", str(out),
                                                   "--num-kv-blocks", "64", "--quiet"])
                    assert res.exit_code == 0, res.output
                    digests.setdefault((name, dtype), {})[(simd, threads)] = golden_digest(out)
    finally:
        torch.set_num_threads(threads_before)
    for key, by_setting in digests.items():
        assert len(set(by_setting.values())) == 1, (arch, key, by_setting)


@pytest.mark.slow
def test_the_default_models_logprobs_are_as_close_to_float64_as_transformers_fp32(default_model_dir) -> None:
    """Issue 39's bar: on the sample prompts, the max and the mean |Δ logprob| of apcscore fp32 against transformers'
    float64 forward of the same weights (eager attention) are no larger than transformers' fp32 ones
    (docs/benchmarks.md, "Portable bits": 1.19e-5 / 1.52e-6 against 1.91e-5 / 7.66e-6 when measured)."""
    from transformers import AutoModelForCausalLM

    from apcscore import EngineConfig, Request, load_engine

    engine = load_engine("smollm2-135m", EngineConfig(dtype="float32"))
    records = [json.loads(line) for line in (ROOT / "datasets" / "sample_prompts.jsonl").open()]
    all_ids = [r["prompt_token_ids"] if "prompt_token_ids" in r else engine.tokenizer(r["prompt"]).input_ids
               for r in records]
    outs = {o.request_id: o for o in engine.run([Request(str(i), ids, prompt_logprobs=1)
                                                  for i, ids in enumerate(all_ids)])}
    ours = torch.cat([torch.from_numpy(outs[str(i)].prompt_logprobs.token_logprobs).double()
                      for i in range(len(all_ids))])
    ref = {}
    for dtype in (torch.float64, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=dtype,
                                                     attn_implementation="eager").eval()
        with torch.no_grad():
            lps = [torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1).gather(
                1, torch.tensor(ids[1:])[:, None])[:, 0].double() for ids in all_ids]
        ref[dtype] = torch.cat(lps)
    assert len(ours) == len(ref[torch.float64]) == sum(len(ids) - 1 for ids in all_ids)
    ours_err, theirs_err = (ours - ref[torch.float64]).abs(), (ref[torch.float32] - ref[torch.float64]).abs()
    assert ours_err.max() <= theirs_err.max(), (float(ours_err.max()), float(theirs_err.max()))
    assert ours_err.mean() <= theirs_err.mean(), (float(ours_err.mean()), float(theirs_err.mean()))
