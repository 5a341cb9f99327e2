# The two commands a new user needs:
#   make demo   set up, build and run the main job (a local kvtier on loopback)
#   make test   set up, build and pass the test suite
# Everything else is a building block of those two.

BUILD_DIR ?= build
BUILD_TYPE ?= RelWithDebInfo
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: all setup venv k8s build test test-busy demo demo-cluster demo-vllm bench bench-vllm bench-frontend fuzz asan tsan soak format clean

all: build

setup:
	@bash scripts/setup.sh

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_FLAGS)

build: setup $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS)

# The project's Python environment: the pinned vLLM CPU build from PyPI in
# $(BUILD_DIR)/venv (reused while python/requirements-vllm.txt is unchanged;
# without PyPI the real-engine tests skip, saying why).
venv: setup
	bash scripts/setup_venv.sh $(BUILD_DIR)

# The test cluster's Kubernetes binaries, built once per version from the
# Go module proxy and cached outside the checkout (scripts/k8s/build.sh;
# about 10 min on 2 cores the first time). Without the proxy the cluster
# test skips, saying why (under CI=true it fails).
k8s: setup
	@bash scripts/k8s/build.sh >/dev/null || [ "$$CI" != true ]

test: build venv k8s
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 300 -LE bench

# The suite beside a CPU hog at nice 19 on every core, BUSY_RUNS times (3)
# in a row; BUSY_TESTS (a ctest -R regex) narrows it (scripts/test_busy.sh).
test-busy: build venv
	bash scripts/test_busy.sh $(BUILD_DIR)

demo: build
	bash scripts/demo.sh $(BUILD_DIR)

# The whole fleet with real engines (minutes): a kvtier store, two vLLM CPU
# servers with kvtier's connector, the frontend in front of them, and vLLM's
# own `vllm bench serve` replaying the Mooncake slice trace through nginx
# (least_conn, round-robin) and through kvtier-frontend, side by side.
# The whole fleet on a local one-node Kubernetes cluster (needs root):
# the chart installed, a trace replayed through the frontend Service.
demo-cluster: build venv k8s
	KVTIER_BUILD_DIR=$(BUILD_DIR) $(BUILD_DIR)/venv/bin/python bench/cluster_demo.py

demo-vllm: build venv
	KVTIER_BUILD_DIR=$(BUILD_DIR) $(BUILD_DIR)/venv/bin/python bench/frontend_bench.py \
		--parts replay --runs 1 --store --datasets mooncake_slice_trace

# kvtier-frontend beside nginx: added latency, forwarding capacity, memory at
# 1,000 streams, and trace replays through each (docs/benchmarks.md).
bench-frontend: build venv
	KVTIER_BUILD_DIR=$(BUILD_DIR) $(BUILD_DIR)/venv/bin/python bench/frontend_bench.py

# Every benchmark, each beside its reference (minutes; not part of make test).
bench: build
	$(BUILD_DIR)/bench/kvtier-bench store
	$(BUILD_DIR)/bench/kvtier-bench dataplane
	$(BUILD_DIR)/bench/kvtier-bench worker
	$(BUILD_DIR)/bench/kvtier-bench router

# kvtier with a real vLLM (CPU build), each beside vLLM alone with equal
# threads, pairs interleaved: a burst, TTFT from the store, headroom, reuse
# beyond the engine's KV memory, and the offloading tier beside vLLM's own
# filesystem tier.
bench-vllm: build venv
	KVTIER_BUILD_DIR=$(BUILD_DIR) $(BUILD_DIR)/venv/bin/python bench/vllm_bench.py

# Each libFuzzer target for FUZZ_SECONDS (clang, ASan + UBSan).
FUZZ_SECONDS ?= 30
fuzz: setup
	bash scripts/fuzz.sh $(FUZZ_SECONDS)

# Lays the C++ out as clang-format does (CI checks it: scripts/check_format.sh).
format: setup
	bash scripts/check_format.sh --fix

# The 10-minute soak (make test runs its 60-second version).
soak: build
	cd $(BUILD_DIR) && KVTIER_SOAK_SECONDS=600 ctest --output-on-failure -L soak --timeout 900

# The test suite under AddressSanitizer / ThreadSanitizer.
asan: setup
	bash scripts/sanitize.sh address
tsan: setup
	bash scripts/sanitize.sh thread

clean:
	rm -rf $(BUILD_DIR)
