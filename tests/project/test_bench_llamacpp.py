"""benchmarks/bench_llamacpp.py and its worker without running the benchmark (minutes, and llama.cpp to build):
the window/stride that gives apcscore's perplexity llama-perplexity's contexts, the chunks, the parsing of
llama-perplexity's output, the log-softmax; with llama_cpp installed (the `bench` extra), that llama.cpp and
apcscore tokenize the benchmark's text alike."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.special import log_softmax as scipy_log_softmax

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_llamacpp  # noqa: E402
import llamacpp_worker  # noqa: E402

from apcscore.jobs.perplexity import rolling_windows  # noqa: E402

# What llama-perplexity prints (tools/perplexity/perplexity.cpp of llama.cpp as vendored by llama-cpp-python 0.3.36:
# a real run's lines, cut), with its log timestamps (minutes.seconds.ms.us); and llama_perf_context_print's lines
# (src/llama-context.cpp), which that build does not print at its default verbosity. The ETA's end and the
# progress ("0.02 minutes", "[1]6.4214,...") go to stdout: read from stderr alone, a line can start mid-line.
TOOL_OUTPUT = """\
0.06.435.830 I perplexity: tokenizing the input ..
0.06.449.061 I perplexity: tokenization took 13.218 ms
0.06.449.079 I perplexity: calculating perplexity over 2 chunks, n_ctx=128, batch_size=2048, n_seq=16
0.15.493.299 I perplexity: 9.04 seconds per pass - ETA 1.15.565.349 I Final estimate: PPL = 9.3306 +/- 2.12667
"""
PERF_LINES = """\
llama_perf_context_print:        load time =      81.33 ms
llama_perf_context_print: prompt eval time =    2881.02 ms /  4096 tokens (    0.70 ms per token,  1421.72 tokens \
per second)
llama_perf_context_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens \
per second)
llama_perf_context_print:       total time =    3074.18 ms /  4097 tokens
"""


def test_parse_llama_perplexity_reads_ppl_chunks_and_timings() -> None:
    got = llamacpp_worker.parse_llama_perplexity(TOOL_OUTPUT)
    assert got["ppl"] == 9.3306 and got["ppl_err"] == 2.12667
    assert (got["chunks"], got["n_ctx"], got["batch_size"], got["n_seq"]) == (2, 128, 2048, 16)
    assert got["compute_s"] == pytest.approx(60 + 15.565349 - 6.449079)  # a minute passes between the lines
    assert "prompt_eval_s" not in got
    got = llamacpp_worker.parse_llama_perplexity(TOOL_OUTPUT + PERF_LINES)
    assert got["prompt_eval_s"] == pytest.approx(2.88102) and got["prompt_eval_tokens"] == 4096
    assert got["load_s"] == pytest.approx(0.08133) and got["total_s"] == pytest.approx(3.07418)
    assert got["eval_tokens"] == 1


def test_parse_llama_perplexity_refuses_output_without_a_final_estimate() -> None:
    with pytest.raises(ValueError, match="Final estimate"):
        llamacpp_worker.parse_llama_perplexity(TOOL_OUTPUT.split("Final")[0])


@pytest.mark.parametrize("n_ctx", [8, 9, 64, 512])
def test_window_stride_gives_llama_perplexity_contexts(n_ctx: int) -> None:
    """Every window of `apcscore perplexity --window W --stride S` after the first feeds n_ctx tokens and scores
    tokens whose contexts are llama-perplexity's: n_ctx // 2 + 1 .. n_ctx - 1 tokens."""
    first, count = llamacpp_worker.scored_span(n_ctx)
    assert first == n_ctx // 2 and first + count == n_ctx - 1
    window, stride = bench_llamacpp.window_stride(n_ctx)
    windows = rolling_windows(10 * n_ctx, window, stride)
    assert sum(w.num_scored for w in windows) == 10 * n_ctx  # every text token once
    for w in windows[1:-1]:
        length = w.end - w.start  # tokens of the request
        contexts = list(range(length - w.num_scored, length))  # position p is predicted from p tokens
        assert length == n_ctx and contexts == list(range(first + 1, n_ctx))


def test_chunk_records_are_llama_perplexity_chunks() -> None:
    ids = list(range(1000))
    chunks = bench_llamacpp.chunk_records(ids, 100, 3)
    assert [c["prompt_token_ids"] for c in chunks] == [ids[:100], ids[100:200], ids[200:300]]
    assert len({c["id"] for c in chunks}) == 3
    with pytest.raises(ValueError, match="too few"):
        bench_llamacpp.chunk_records(ids[:150], 100, 1)  # llama-perplexity needs 2 * n_ctx tokens


def test_log_softmax_matches_scipy() -> None:
    logits = np.random.default_rng(0).normal(0, 8, size=(7, 1000)).astype(np.float32)
    np.testing.assert_allclose(llamacpp_worker.log_softmax(logits), scipy_log_softmax(logits.astype(np.float64),
                                                                                        axis=-1), atol=1e-12)


@pytest.mark.slow
def test_llama_cpp_tokenizes_like_apcscore() -> None:
    """Both sides score the same tokens only if llama.cpp's tokenizer agrees with apcscore's on the text."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from apcscore.models.loading import load_tokenizer
    from apcscore.models.locate import resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m")[0])
    stream, _ = bench_llamacpp.corpus_token_stream(tok)
    text = tok.decode(stream[:3000])
    llm = llama_cpp.Llama(model_path=str(bench_llamacpp.gguf_file()), vocab_only=True, verbose=False)
    assert llm.tokenize(text.encode(), add_bos=True) == tok(text, add_special_tokens=False).input_ids
