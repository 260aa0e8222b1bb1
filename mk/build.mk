# Build and packaging targets (included by the top-level Makefile).
#
#   make build TAG=v2.6.0 [ARCH=x86_64|ppc64le] [CUDA=12.6] [PYTHON=3.11] [PYTHON_EXE=PATH]
#              [SOURCES=DIR | REMOTE=URL | MIRROR=PATH] [WORK=work] [MAX_JOBS=N]
#              (one source: MIRROR wins over REMOTE, REMOTE over SOURCES, as in the Makefile)
#              [DRY_RUN=1] [PREFLIGHT=1] [SKIP_TESTS=1]
#   make channel [CHANNEL=DIR]                      reindex the private conda channel in DIR
#                                                   (default WORK/channel)
#   make recipe-render [ARCH=..] [PYTHON=..] [CUDA=..]   show the rendered conda recipe
#
# A full build needs a CUDA build host (see recipes/README.md); `make build DRY_RUN=1` prints
# the plan anywhere.

PY ?= python3
LMSTOOL ?= LMSTOOL_FRONTEND=make $(PY) -m lmstool
TAG ?=
ARCH ?=
CUDA ?=
PYTHON ?=
PYTHON_EXE ?=
SOURCES ?=
REMOTE ?=
MIRROR ?=
WORK ?= work
MAX_JOBS ?=
CHANNEL ?= $(WORK)/channel

LMS_BUILD_ARGS = $(TAG) --work $(WORK) \
	$(if $(ARCH),--arch $(ARCH)) \
	$(if $(CUDA),--cuda $(CUDA)) \
	$(if $(PYTHON),--python $(PYTHON)) \
	$(if $(PYTHON_EXE),--python-exe $(PYTHON_EXE)) \
	$(SOURCE_ARGS) \
	$(if $(MAX_JOBS),--max-jobs $(MAX_JOBS)) \
	$(if $(filter 1 yes true,$(SKIP_TESTS)),--skip-tests) \
	$(if $(filter 1 yes true,$(DRY_RUN)),--dry-run) \
	$(if $(filter 1 yes true,$(PREFLIGHT)),--preflight)

.PHONY: build channel recipe-render
build: venv ## check out, patch, build wheel + conda package, run the regression suite (DRY_RUN=1: plan only)
	$(SOURCE_NOTICE)
	$(LMSTOOL) build $(LMS_BUILD_ARGS)

channel: venv ## index the private conda channel in CHANNEL=DIR (default WORK/channel)
	@echo "make channel: indexing $(CHANNEL) (CHANNEL=DIR indexes another folder)"
	$(LMSTOOL) channel index $(CHANNEL)

recipe-render: venv ## render the conda recipe for ARCH/CUDA/PYTHON
	$(LMSTOOL) recipe render $(if $(TAG),--tag $(TAG)) --arch $(or $(ARCH),x86_64) \
		--python $(or $(PYTHON),3.11) --cuda $(or $(CUDA),12.6)
