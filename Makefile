# One command per job. Extra arguments go in ARGS, e.g. `make test ARGS="-m unit"` or
# `make bench ARGS="--only generator"`.
#   make test    the three test tiers (scripts/test.sh: set-up first, then pytest)
#   make bench   every benchmark; stores each section's results in benchmarks/ and rewrites
#                BENCHMARKS.md from them (about 35 minutes on 2 cores; ARGS=--render: no measuring)
#   make soak    the long soak run: memory and stream lengths flat over STREAMRL_SOAK_STEPS steps (300)
#   make fuzz    a longer schema fuzz of every service's HTTP API (STREAMRL_FUZZ_EXAMPLES per operation)
PY := .venv/bin/python
ARGS ?=
STREAMRL_FUZZ_EXAMPLES ?= 200

.PHONY: setup test bench soak fuzz

setup:
	bash scripts/setup.sh

test:
	bash scripts/test.sh $(ARGS)

bench: setup
	$(PY) -m streamrl.cli bench $(ARGS)

soak: setup
	STREAMRL_LONG_TESTS=1 $(PY) -m pytest -m soak tests/soak $(ARGS)

fuzz: setup
	STREAMRL_FUZZ_EXAMPLES=$(STREAMRL_FUZZ_EXAMPLES) $(PY) -m pytest tests/integration/test_fuzz_http.py $(ARGS)
