# Two commands matter: `make demo` runs the main job, `make test` runs every test.
# Both create .venv on first use and install the pinned toolchain into it.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch==2.13.0 resolves to the local CPU wheel on the CPU machines; triton==3.7.1 is what CUDA torch 2.13 uses
PINS := torch==2.13.0 triton==3.7.1 'nbdev==2.4.14' 'fastcore>=1.12.3,<2' 'execnb<0.2' 'ghapi<2'

.PHONY: install demo test check-sync nbtest pytest clean

$(VENV)/.installed: settings.ini setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
	$(PIP) install -q $(PINS) 2>&1 | grep -v '^WARNING: Location' || true
	$(PIP) install -q -e '.[dev]' 2>&1 | grep -v '^WARNING: Location' || true
	$(PY) -c "import torch, triton, transformers, nbdev, dflash_nb"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/nbdev_export
	$(PY) -m dflash_nb.train

# CI fails when exporting or cleaning would change a tracked file: notebooks are the source.
check-sync: install
	$(VENV)/bin/nbdev_export
	$(VENV)/bin/nbdev_clean
	@if [ -n "$$(git status --porcelain --untracked-files=no)" ] || [ -n "$$(git status --porcelain | grep '^??' | grep -E '^\?\? (dflash_nb|nbs)/')" ]; then \
	  echo "notebooks and package out of sync, or a notebook is not clean:"; git status --porcelain; git --no-pager diff --stat; exit 1; fi

# slow cells run in CI too; gpu cells only where a CUDA device is present
TEST_FLAGS := slow $(shell $(PY) -c "import torch; print('gpu' if torch.cuda.is_available() else '')" 2>/dev/null)

nbtest: install
	$(VENV)/bin/nbdev_test --n_workers 2 --timing --flags "$(TEST_FLAGS)"

pytest: install
	$(VENV)/bin/pytest -q tests

test: check-sync nbtest pytest

clean:
	rm -rf $(VENV) build *.egg-info
