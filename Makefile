# Two commands on a fresh machine: `make run` and `make test`. Each creates .venv if needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install lint bench docs clean

EXTRAS := dev,deepspeed,jax,mlflow,wandb,clearml,s3,tensorboard,docs,ray
# uv installs the extras in parallel (minutes faster than pip); tools/uv_install.py hands it
# pip's configuration (wheel folders, indexes, the torch cap). `make INSTALLER=pip` uses pip.
INSTALLER ?= uv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: a bare `torch` can pull a multi-GB CUDA build on these machines.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
ifeq ($(INSTALLER),uv)
	$(BIN)/python -m pip install -q uv
	$(BIN)/python tools/uv_install.py $(BIN)/python $(BIN)/uv -q -e ".[$(EXTRAS)]"
else
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
endif
	touch $(STAMP)

install: $(STAMP)

# The default recipe on every local device (2 CPU processes on a 2-core machine): a small GPT
# on the stdlib's source, progress bar, runs/gpt-stdlib/ (metrics, checkpoints, plot), a sample.
run: $(STAMP)
	$(BIN)/accumix train

# tests/docs runs every code block of README.md and docs/ and builds the site strictly.
# Two workers (pytest-xdist); tests that share a spawned job, a module-scoped fixture or a
# session's server run on one worker (the xdist groups tests/conftest.py assigns).
# PYTHONDONTWRITEBYTECODE emptied: a machine that sets it (ours do) would have every process
# the suite starts (ranks, launchers, Ray's workers) compile jax, ray, mlflow, ... from source
# again (uv installs no .pyc): 2-4 s of CPU each. Written once, into .venv and __pycache__/.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff check .
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup tests

# The docs site into site/ (open site/index.html); --strict: a broken link, anchor or API
# reference fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) runs site .pytest_cache
