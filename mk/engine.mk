# Engine tiers (see docs/tooling.md, "Verification ladder"):
#   make engine                  T1: patched c10 + c10_cuda of TAG built on the simulated GPU,
#                                engine suite and simgpu tests run (RUNTIME=real on a GPU host)
#   make ppc64le                 the same cross-built for ppc64le and run under qemu-user
#   make gpu-engine|gpu-regression|gpu-matrix|gpu-stress|gpu-benchmarks MODEL=...|gpu-compile-peers
#                                T2/T3 on a machine with a GPU (results under OUT)
RUNTIME ?= sim
MODEL ?= gpt
OUT ?= out

.PHONY: engine ppc64le gpu-engine gpu-regression gpu-matrix gpu-stress gpu-benchmarks \
	gpu-compile-peers

engine: patch ## build TAG's patched c10/c10_cuda (RUNTIME=sim|real) and run the engine suite
	PYTHON=$(PY) standalone/build.sh --source $(TREE) --build $(WORK)/engine-$(TAG)-$(RUNTIME) --runtime $(RUNTIME) --test

ppc64le: patch ## cross-build the patched c10/c10_cuda and engine suite for ppc64le, run under qemu
	scripts/install-deps.sh scripts/apt-packages-ppc64le.txt
	@# fmt's headers and nvml.h come from .carry/ (scripts/prepare-carry.sh, once, networked)
	test -f .carry/root/usr/include/fmt/format.h -a -f .carry/nvml/include/nvml.h || scripts/prepare-carry.sh
	standalone/cross-ppc64le.sh --source $(TREE) --build $(WORK)/engine-ppc64le

gpu-engine: ## on a GPU host: engine suite and copy benchmark on the real GPU (needs .carry/)
	OUT=$(abspath $(OUT))/engine scripts/gpu/run-engine.sh

gpu-regression: ## on a GPU host: build the drop-in extension, run tests/regression
	OUT=$(abspath $(OUT))/regression scripts/gpu/run-regression.sh

gpu-matrix: ## on a GPU host: regression matrix of model families (PYTEST_ARGS='-k capped|share|nocap|ddp')
	OUT=$(abspath $(OUT))/matrix scripts/gpu/run-matrix.sh

gpu-stress: ## on a GPU host: randomized stress suite (STRESS_START=, STRESS_ARGS='--jobs 8')
	OUT=$(abspath $(OUT))/stress scripts/gpu/run-stress.sh

gpu-benchmarks: ## on a GPU host: compare LMS with the alternatives for MODEL=gpt|resnet152|vit_l
	OUT=$(abspath $(OUT))/benchmarks scripts/gpu/run-benchmarks.sh $(MODEL)

gpu-compile-peers: ## on a GPU host: LMS under torch.compile against PyTorch's compile-time savers
	OUT=$(abspath $(OUT))/compile-peers scripts/gpu/run-compile-peers.sh
