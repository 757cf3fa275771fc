# The two entry points of the README. Both set everything up first (scripts/setup.sh is idempotent).
.PHONY: setup serve test bench

setup:
	./scripts/setup.sh

serve: setup
	.venv/bin/pagedserve serve $(ARGS)

test: setup
	.venv/bin/python -m pytest -q $(ARGS)

bench: setup
	.venv/bin/python -m loadtest.bench $(ARGS)
