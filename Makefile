# PyTorch Large Model Support: driver for the patch series, tests and builds.
#
#   make patch TAG=v2.6.0      get PyTorch v2.6.0 and apply the LMS series (work/pytorch-v2.6.0)
#   make test                  run the test suite
#   make help                  list every target
#
# Every target first installs the missing Debian/Ubuntu packages of scripts/apt-packages.txt
# (as root, or through sudo) and the virtual environment .venv.
#
# Variables (set on the command line, e.g. `make patch TAG=v2.6.0 SOURCES=../tarballs`):
#   TAG      release tag from config/tags.yaml (default v2.6.0)
#   SOURCES  folder holding the tag's release tarball (checked by sha256) instead of GitHub;
#            for `make test`, the tarballs the tests of real PyTorch sources read (the folder
#            must exist: `make sources SOURCES=DIR` fills it; without SOURCES those tests skip)
#   REMOTE   git remote to clone the tag from instead of GitHub (e.g. file:///srv/pytorch.git)
#   MIRROR   local clone holding the tag, instead of GitHub
#            (default, none of the three: clone the tag from GitHub with its submodules;
#            given together, MIRROR wins over REMOTE and REMOTE over SOURCES, and the targets
#            that check out a tag say so in one line: SOURCES kept in the environment for
#            `make test` does not stop a `make patch MIRROR=PATH`)
#   WORK     scratch area for checkouts, builds and the source cache (git-ignored)
#   VENV     virtual environment with the tooling and test dependencies

TAG ?= v2.6.0
SOURCES ?=
REMOTE ?=
MIRROR ?=
WORK ?= work
VENV ?= .venv
# lmstool's cache of imported source tarballs lives in WORK too (LMS_CACHE, when set, wins).
export LMS_CACHE ?= $(abspath $(WORK))/cache
PY := $(VENV)/bin/python
# LMSTOOL_FRONTEND=make: lmstool's messages name make variables (SOURCES=DIR, not --sources DIR).
# LMSTOOL_MAKE_VARS (in lmstool's environment): the source and work variables given to make,
# which lmstool appends to the make commands it suggests.
export LMSTOOL_MAKE_VARS := $(strip $(foreach v,SOURCES REMOTE MIRROR,$(if $(strip $($(v))),$(v)=$($(v)))) \
	$(if $(filter-out work,$(WORK)),WORK=$(WORK)))
LMSTOOL := LMSTOOL_FRONTEND=make $(PY) -m lmstool
# Where the targets that check out a tag (patch, verify, patches, build) get it: the first of
# MIRROR, REMOTE and SOURCES given, else GitHub. SOURCE_NOTICE, a recipe line, says which won
# when more than one was given (it prints while make expands the recipe, -n included).
SOURCE_VARS := $(strip $(foreach v,MIRROR REMOTE SOURCES,$(if $(strip $($(v))),$(v))))
SOURCE_USED := $(if $(SOURCE_VARS),$(firstword $(SOURCE_VARS))=$(strip $($(firstword $(SOURCE_VARS)))))
SOURCE_UNUSED := $(foreach v,$(wordlist 2,3,$(SOURCE_VARS)),$(v)=$(strip $($(v))))
SOURCE_ARGS := $(if $(strip $(MIRROR)),--mirror $(MIRROR),$(if $(strip $(REMOTE)),--remote $(REMOTE),$(if $(strip $(SOURCES)),--sources $(SOURCES))))
SOURCE_NOTICE = $(if $(SOURCE_UNUSED),$(info make: the tag comes from $(SOURCE_USED); \
	$(SOURCE_UNUSED) not used for it (MIRROR wins over REMOTE, REMOTE over SOURCES)))
TREE := $(WORK)/pytorch-$(TAG)
# `make patches` / `make verify`: only TAG when it was given, otherwise every tag.
TAGS_GIVEN := $(if $(filter command line environment,$(origin TAG)),$(TAG))

.DEFAULT_GOAL := help
.PHONY: help deps venv sources patch verify patches tables test lint recipe-sync

help: ## list the targets
	@echo "PyTorch Large Model Support (TAG=$(TAG), source: $(or $(SOURCE_USED),GitHub)$(if $(SOURCE_UNUSED), ($(SOURCE_UNUSED) not used)), WORK=$(WORK))"
	@echo "A tag is checked out from MIRROR=PATH, else REMOTE=URL, else SOURCES=DIR, else GitHub;"
	@echo "make test reads the tarballs in SOURCES=DIR for the tests of real PyTorch sources."
	@echo
	@grep -hE '^[a-zA-Z0-9_.-]+:.*## ' $(MAKEFILE_LIST) \
		| awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

deps: ## install the missing system packages of scripts/apt-packages.txt (root or sudo)
	@scripts/install-deps.sh

$(VENV)/.installed: pyproject.toml | deps
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	scripts/install-test-torch.sh $(PY)
	@touch $@

venv: $(VENV)/.installed ## create .venv with the tooling and test dependencies

sources: venv ## download the source tarballs of every tag with a series (or TAG=...) into SOURCES (default WORK/sources)
	$(LMSTOOL) fetch $(TAGS_GIVEN) --to $(or $(strip $(SOURCES)),$(WORK)/sources)

patch: venv ## check out TAG into WORK/pytorch-TAG and apply its series
	$(SOURCE_NOTICE)
	$(LMSTOOL) checkout $(TAG) --require-series --dest $(TREE) $(SOURCE_ARGS)
	$(LMSTOOL) apply $(TAG) --tree $(TREE)
	@echo "patched tree ready to build: $(abspath $(TREE))"

verify: venv ## check every committed series applies and is up to date (or TAG=...)
	$(SOURCE_NOTICE)
	$(LMSTOOL) verify $(TAGS_GIVEN) $(SOURCE_ARGS)

patches: venv ## regenerate patches/TAG/ from engine/ + integration/TAG/ (all tags unless TAG=...)
	$(SOURCE_NOTICE)
	$(LMSTOOL) patches $(TAGS_GIVEN) $(SOURCE_ARGS)
	$(LMSTOOL) series-size --readme docs/tooling.md

tables: venv ## rewrite the Python lists made from the engine's tables of settings and statistics
	$(LMSTOOL) tables

# `make test SOURCES=DIR` with no folder DIR would pass with the tests of real PyTorch sources
# skipped (they look for their tarballs there): stop before anything is installed or run.
ifneq ($(filter test,$(MAKECMDGOALS)),)
ifneq ($(strip $(SOURCES)),)
ifeq ($(wildcard $(strip $(SOURCES))/.),)
$(error make test: SOURCES=$(strip $(SOURCES)) is not a folder, so the tests of real PyTorch \
	sources would all skip. Run `make sources SOURCES=$(strip $(SOURCES))` to download the \
	tarballs there, name the folder that holds them, or leave out SOURCES= to run without them)
endif
endif
endif
test: venv ## run the test suite (SOURCES=DIR: an existing folder of the tarballs the tests of real PyTorch sources read)
	LMS_SOURCES='$(if $(strip $(SOURCES)),$(abspath $(SOURCES)))' $(PY) -m pytest tests -ra

# C++ checked by clang-format with PyTorch's style (.clang-format at the root).
CXX_LINT_DIRS := engine extension simgpu tests standalone
lint: venv ## ruff lint and format check; clang-format check of the C++ (names each file off style)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check lmstool lmsbench tests/tooling tests/packaging
	scripts/clang-format-check.sh $(CXX_LINT_DIRS)

recipe-sync: venv ## write the recipe's generated parts from config/ and patches/ (CI checks them)
	$(LMSTOOL) recipe sync

# Build, engine and packaging targets (make build, make engine, make ppc64le, ...) live in
# mk/*.mk, one file per area; they see the variables above.
-include $(sort $(wildcard mk/*.mk))
