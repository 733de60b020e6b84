# Thin wrapper over CMake. `make run` and `make test` do all the set-up on a fresh Debian/Ubuntu
# machine (packages through scripts/deps.sh, then the build).
BUILD ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 10
FUZZ_CC ?= clang
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

.PHONY: all deps build run test test-sanitize test-tsan fuzz format clean

all: build

deps:
	@bash scripts/deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

run: build
	./$(BUILD)/llmem plan models/pycoder
	./$(BUILD)/llmem run models/pycoder --stats -n 96 \
		-p "$$(printf 'import os\nimport sys\n\n\ndef main():\n')"

# The suite, then every fuzz target for FUZZ_SECONDS (`make fuzz`; clang comes through deps.sh like
# the other packages). `make test FUZZ_SECONDS=0` leaves the fuzzing out (the corpora are still
# replayed by ctest's fuzz-* tests).
test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)
	@if [ "$(FUZZ_SECONDS)" != 0 ]; then $(MAKE) --no-print-directory fuzz; fi

test-sanitize: deps
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DLLMEM_SANITIZE=ON -DLLMEM_CUDA=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
		ctest --test-dir $(ASAN_BUILD) --output-on-failure -j $(JOBS)

# The threaded tests under ThreadSanitizer.
test-tsan: deps
	@cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DLLMEM_TSAN=ON -DLLMEM_CUDA=OFF $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(TSAN_BUILD) -j $(JOBS) --target test-mem test-core test-kv test-spill test-sched test-grammar test-forward
	TSAN_OPTIONS=halt_on_error=1 ctest --test-dir $(TSAN_BUILD) --output-on-failure -j $(JOBS) \
		-R '^((test-mem|test-core|test-kv|test-spill|test-sched|test-grammar)(:.*)?|test-forward:threads)$$'

# Each libFuzzer target of tests/fuzz for FUZZ_SECONDS, JOBS at a time, from a copy of its seed
# corpus (what it finds stays in $(FUZZ_BUILD)/corpus, not in the tree); fails on any crash, leak,
# timeout or sanitizer report, whose reproducer libFuzzer writes to $(FUZZ_BUILD)/artifacts
# (scripts/fuzz.sh).
fuzz:
	@bash scripts/deps.sh clang libclang-rt-dev
	@cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=$(FUZZ_CC) \
		-DLLMEM_FUZZ=ON -DLLMEM_CUDA=OFF $(CMAKE_FLAGS) >/dev/null
	@bash scripts/fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS) $(JOBS)

format:
	clang-format -i $$(git ls-files '*.c' '*.h' '*.cu')

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD)
