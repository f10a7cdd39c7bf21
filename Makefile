SHELL := /bin/bash
# The two commands of the README: `make run` and `make test`. Both set up what
# they need (venv, packages, tiny model) and skip whatever is already done.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.forge-installed
CONFIG ?= configs/grpo_tiny.yaml
PYTEST_ARGS ?=

COOKBOOK := .venv-cookbook

.PHONY: install run test lint docs clean cookbook

$(STAMP): pyproject.toml forge/install.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m forge.install 2>&1 | grep -v "is ignored: it is neither a file nor a directory" ; test $${PIPESTATUS[0]} -eq 0
	touch $(STAMP)

install: $(STAMP)

# The tinker-cookbook's recipes, as a client of `forge tinker` (their own venv: see pyproject.toml).
$(COOKBOOK)/.installed: pyproject.toml forge/install.py
	test -x $(COOKBOOK)/bin/python || python3 -m venv $(COOKBOOK)
	$(COOKBOOK)/bin/python -m forge.install --cookbook 2>&1 | grep -v "is ignored: it is neither a file nor a directory" ; test $${PIPESTATUS[0]} -eq 0
	touch $@

cookbook: $(COOKBOOK)/.installed

run: $(STAMP)
	$(PY) -m forge.cli run $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The manual (docs/, mkdocs.yml) into site/; a broken link or reference fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) $(COOKBOOK) .cache runs site
