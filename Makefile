# PyTorch Large Model Support: driver for the patch series, tests and builds.
#
#   make patch TAG=v2.6.0      get PyTorch v2.6.0 and apply the LMS series (work/pytorch-v2.6.0)
#   make test                  run the test suite
#   make help                  list every target
#
# Variables (set on the command line, e.g. `make patch TAG=v1.13.1 SOURCES=`):
#   TAG      release tag from config/tags.yaml (default v2.6.0)
#   SOURCES  folder of release tarballs checked by sha256; blank: clone from GitHub
#   WORK     scratch area for checkouts and builds (git-ignored)
#   VENV     virtual environment with the tooling and test dependencies

TAG ?= v2.6.0
SOURCES ?= ../shared/sources
WORK ?= work
VENV ?= .venv
PY := $(VENV)/bin/python
LMSTOOL := $(PY) -m lmstool
SOURCE_ARGS := $(if $(strip $(SOURCES)),--sources $(SOURCES))
TREE := $(WORK)/pytorch-$(TAG)
# `make patches` / `make verify`: only TAG when it was given, otherwise every tag.
TAGS_GIVEN := $(if $(filter command line environment,$(origin TAG)),$(TAG))

.DEFAULT_GOAL := help
.PHONY: help venv patch verify patches test lint

help: ## list the targets
	@echo "PyTorch Large Model Support (TAG=$(TAG), SOURCES=$(or $(SOURCES),<GitHub>), WORK=$(WORK))"
	@echo
	@grep -hE '^[a-zA-Z0-9_.-]+:.*## ' $(MAKEFILE_LIST) \
		| awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	scripts/install-test-torch.sh $(PY)
	@touch $@

venv: $(VENV)/.installed ## create .venv with the tooling and test dependencies

patch: venv ## check out TAG into WORK/pytorch-TAG and apply its series
	$(LMSTOOL) checkout $(TAG) --dest $(TREE) $(SOURCE_ARGS)
	$(LMSTOOL) apply $(TAG) --tree $(TREE)
	@echo "patched tree ready to build: $(abspath $(TREE))"

verify: venv ## check every committed series applies and is up to date (or TAG=...)
	$(LMSTOOL) verify $(TAGS_GIVEN) $(SOURCE_ARGS)

patches: venv ## regenerate patches/TAG/ from engine/ + integration/TAG/ (all tags unless TAG=...)
	$(LMSTOOL) patches $(TAGS_GIVEN) $(SOURCE_ARGS)

test: venv ## run the test suite (slow tests use the tarballs in SOURCES)
	LMS_SOURCES='$(if $(strip $(SOURCES)),$(abspath $(SOURCES)))' $(PY) -m pytest tests -ra

lint: venv ## ruff lint and format check
	$(PY) -m ruff check .
	$(PY) -m ruff format --check lmstool tests/tooling

# Build, engine and packaging targets (make build, make engine, make ppc64le, ...) live in
# mk/*.mk, one file per area; they see the variables above.
-include $(sort $(wildcard mk/*.mk))
