# make demo: set up, generate the demo plans, check them.   make test: the test suite
# (two workers; under 10 minutes on 2 cores, docs/workflow.md "Set up and the test suite").
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PLANS := gen_model/mgeners
MLP_SINGLE := $(PLANS)/mlp_default_dp1_pp1_tp1_nm1_gbs128_ly2_h0_hi128_sq0.pkl
MLP_PARALLEL := $(PLANS)/mlp_default_dp2_pp2_tp2_nm2_gbs128_ly2_h0_hi128_sq0.pkl
# a caught bug: bug-suite plan br1 (docs/bugs.md) on a small llama3
LLAMA := --model llama3 --layers 2 --heads 4 --kv_heads 2 --hidden 128 --seqlen 128 --gbs 32
LLAMA_SINGLE := $(PLANS)/llama3_default_dp1_pp1_tp1_nm1_gbs32_ly2_h4_hi128_sq128.pkl
LLAMA_BR1 := $(PLANS)/llama3_br1_dp2_pp2_tp2_nm2_gbs32_ly2_h4_hi128_sq128.pkl

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# torch's CPU build first: on these machines 'torch==2.13.0' resolves to a local
	@# CPU wheel; a plain 'torch' requirement would pull the CUDA build instead.
	$(BIN)/pip install -q torch==2.13.0 || $(BIN)/pip install -q torch
	@# the third-party extras (transformers, torchtitan, triton) so the tests that trace
	@# them run; their torch requirement is met by the CPU build above
	$(BIN)/pip install -q -e '.[dev,ray,thirdparty]'
	touch $(STAMP)

$(MLP_SINGLE): $(STAMP)
	$(BIN)/python -m gen_model --model mlp --layers 2 --hidden 128 --gbs 128

$(MLP_PARALLEL): $(STAMP)
	$(BIN)/python -m gen_model --model mlp --layers 2 --hidden 128 --gbs 128 \
		--dp 2 --pp 2 --tp 2 --nm 2

$(LLAMA_SINGLE): $(STAMP)
	$(BIN)/python -m gen_model $(LLAMA)

$(LLAMA_BR1): $(STAMP)
	$(BIN)/python -m gen_model $(LLAMA) --dp 2 --pp 2 --tp 2 --nm 2 --variant br1

demo: $(MLP_SINGLE) $(MLP_PARALLEL) $(LLAMA_SINGLE) $(LLAMA_BR1)
	@echo "== the mlp demo pair: equivalent"
	$(BIN)/python main.py --sm $(MLP_SINGLE) --pm $(MLP_PARALLEL) --time --no_cache_stages
	$(BIN)/python main.py --sm $(MLP_SINGLE) --pm $(MLP_PARALLEL) --numeric
	@echo "== bug br1, a tensor-parallel all_reduce run on a group of one rank: caught"
	@$(BIN)/python main.py --sm $(LLAMA_SINGLE) --pm $(LLAMA_BR1); code=$$?; \
	if [ $$code -ne 1 ]; then echo "demo: br1 should FAIL (exit 1), got exit $$code"; exit 1; fi
	@echo "demo: both verdicts as expected: the demo pair is equivalent (SUCCESS), br1 is not (FAIL)"

# two workers (pytest-xdist), each test file on one worker so its fixtures are built once
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(PLANS) data/cache data/logs
