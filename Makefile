# make demo: set up, generate the demo plans, check them.   make test: the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PLANS := gen_model/mgeners
MLP_SINGLE := $(PLANS)/mlp_default_dp1_pp1_tp1_nm1_gbs128_ly2_h0_hi128_sq0.pkl
MLP_PARALLEL := $(PLANS)/mlp_default_dp2_pp2_tp2_nm2_gbs128_ly2_h0_hi128_sq0.pkl

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# torch's CPU build first: on these machines 'torch==2.13.0' resolves to a local
	@# CPU wheel; a plain 'torch' requirement would pull the CUDA build instead.
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q torch
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

$(MLP_SINGLE): $(STAMP)
	$(BIN)/python -m gen_model --model mlp --layers 2 --hidden 128 --gbs 128

$(MLP_PARALLEL): $(STAMP)
	$(BIN)/python -m gen_model --model mlp --layers 2 --hidden 128 --gbs 128 \
		--dp 2 --pp 2 --tp 2 --nm 2

demo: $(MLP_SINGLE) $(MLP_PARALLEL)
	$(BIN)/python main.py --sm $(MLP_SINGLE) --pm $(MLP_PARALLEL) --time --no_cache_stages
	$(BIN)/python main.py --sm $(MLP_SINGLE) --pm $(MLP_PARALLEL) --numeric

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(PLANS) data/cache data/logs
