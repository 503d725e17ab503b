# hami-bpf: `sudo make install && sudo hami-bpf run`; `sudo make test`.
# VENV=/path selects another virtual environment (default /opt/hami-bpf/venv,
# shared by every checkout on the host: the last `make install` owns it).
#
# install       what `hami-bpf run` needs, nothing more
# install-test  that plus the test extras (pytest, hypothesis, ...) and tmux
# install-containers  that plus podman and mmdebstrap (test-containers)
# test          the whole suite = test-unit + test-bpf, in one pytest run
# test-unit     everything but tests/bpf and tests/kernels (no root needed)
# test-bpf      tests/bpf and tests/kernels: real uprobes on this host
# test-kernels  the BPF tests on other kernels booted in qemu (docs/kernels.md)
# test-containers  the image built (deploy/build-image.sh) and run under podman
#               with the DaemonSet's privileges, workloads in containers
#               (tests/containers; not part of `make test`)
SHELL := /bin/bash
VENV ?= /opt/hami-bpf/venv
PYTHON := $(VENV)/bin/python
HAMI_HYPOTHESIS_EXAMPLES ?= 3000
export HAMI_HYPOTHESIS_EXAMPLES

.PHONY: install install-test install-containers test test-unit test-bpf test-kernels test-containers demo clean

install:
	HAMI_BPF_VENV=$(VENV) bash scripts/setup-host.sh

install-test:
	HAMI_BPF_VENV=$(VENV) bash scripts/setup-host.sh --test

# pytest on $(1); its exit code 5 ("no tests collected") is a failure here.
define pytest
	@rc=0; $(PYTHON) -m pytest $(1) -v -rs || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make $@: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc
endef

test: install-test
	$(call pytest,tests --ignore=tests/containers)

test-unit: install-test
	$(call pytest,tests --ignore=tests/bpf --ignore=tests/kernels --ignore=tests/containers)

test-bpf: install-test
	$(call pytest,tests/bpf tests/kernels)

# BPF tests on other kernels: Debian's newest 7.x and 6.1 booted in qemu (TCG
# where nested KVM fails), plus the host's kernel; see docs/kernels.md.
test-kernels: install-test
	bash tests/kernels/setup.sh
	VENV=$(VENV) $(PYTHON) tests/kernels/run_matrix.py

# The agent's image and the DaemonSet under podman (docs/kubernetes.md). Uses
# the host's BPF and bpffs: not at the same time as test-bpf.
install-containers:
	HAMI_BPF_VENV=$(VENV) bash scripts/setup-host.sh --containers

test-containers: install-containers
	$(call pytest,tests/containers -x)

demo: install
	$(VENV)/bin/hami-bpf run

clean:
	rm -rf build dist .pytest_cache .hypothesis tests/build
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -rf /var/cache/hami-bpf/fakecuda 2>/dev/null || true
