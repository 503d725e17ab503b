# hami-bpf: `sudo make install && sudo hami-bpf run`; `sudo make test`.
# VENV=/path selects another virtual environment (default /opt/hami-bpf/venv,
# shared by every checkout on the host: the last `make install` owns it).
SHELL := /bin/bash
VENV ?= /opt/hami-bpf/venv
PYTHON := $(VENV)/bin/python
HAMI_HYPOTHESIS_EXAMPLES ?= 3000
export HAMI_HYPOTHESIS_EXAMPLES

.PHONY: install test demo clean

install:
	HAMI_BPF_VENV=$(VENV) bash scripts/setup-host.sh

# pytest's exit code 5 ("no tests collected") is a failure here.
test: install
	@rc=0; $(PYTHON) -m pytest tests -v -rs || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# BPF tests on other kernels: Debian's newest 7.x and 6.1 booted in qemu (TCG
# where nested KVM fails), plus the host's kernel; see docs/kernels.md.
.PHONY: test-kernels
test-kernels: install
	bash tests/kernels/setup.sh
	$(PYTHON) tests/kernels/run_matrix.py

demo: install
	$(VENV)/bin/hami-bpf run

clean:
	rm -rf build dist .pytest_cache .hypothesis tests/build
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -rf /var/cache/hami-bpf/fakecuda 2>/dev/null || true
