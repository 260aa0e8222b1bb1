# Prebuilt drop-in packages (included by the top-level Makefile).
#
#   make dropin [DROPIN_TORCH="2.11.0 2.12.1"] [CUDA=13.0] [PYTHON=3.12 PYTHON_INCLUDE=DIR]
#               [DROPIN_OUT=WORK/dropin-wheels] [CHANNEL=WORK/channel]
#
# Builds torch_lms for each torch release (default: every release lmstool dropin knows) from
# the CUDA torch wheels, without a GPU, into DROPIN_OUT/cu<XY>/, and its conda package into
# CHANNEL. PYTHON_INCLUDE: headers of a target Python absent here (with PYTHON=X.Y).
DROPIN_TORCH ?=
DROPIN_OUT ?= $(WORK)/dropin-wheels
PYTHON_INCLUDE ?=

.PHONY: dropin
dropin: venv ## build the drop-in wheel and conda package per torch release (DROPIN_TORCH=, CUDA=, PYTHON=)
	$(LMSTOOL) dropin --out $(DROPIN_OUT) --channel $(or $(CHANNEL),$(WORK)/channel) \
		--cuda $(or $(CUDA),13.0) \
		$(foreach v,$(DROPIN_TORCH),--torch $(v)) \
		$(if $(PYTHON),--python $(PYTHON)) \
		$(foreach d,$(PYTHON_INCLUDE),--python-include $(d))
