# kvtrace-bpf.  Run as root: `make setup`, `make demo`, `make test`.
SHELL := /bin/bash
# The distribution's python3: bcc (python3-bpfcc) is installed for it only.
SYSTEM_PYTHON := /usr/bin/python3
VENV := .venv
STAMPS := .stamps
KVSIM := tests/target/kvsim

.PHONY: setup packages kernel-headers tracefs venv target test demo clean

setup: packages kernel-headers tracefs venv target
	@echo "setup: done"

# Slow steps are guarded by stamps: a second `make setup` takes a second.
packages: $(STAMPS)/packages
$(STAMPS)/packages: scripts/setup-packages.sh
	scripts/setup-packages.sh
	@mkdir -p $(STAMPS) && touch $@

# Cheap and not stamped: a reboot loses both.
kernel-headers: packages
	@scripts/setup-kernel-headers.sh
tracefs:
	@scripts/setup-tracefs.sh

venv: $(STAMPS)/venv
$(STAMPS)/venv: setup.cfg pyproject.toml $(STAMPS)/packages
	$(SYSTEM_PYTHON) -m venv --system-site-packages $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[test]'
	$(VENV)/bin/python -c "import bcc, tracer"
	@touch $@

target: packages
	@$(MAKE) -s -C tests/target

test: setup
	$(VENV)/bin/python -m pytest tests

# The main job on the embedded default: kvsim traced live for a few seconds.
demo: setup
	$(VENV)/bin/kvtrace-bpf attach --interval 0.5 -- \
		$(KVSIM) --workload default --repeat 4 --step-delay-us 20000 --quiet

clean:
	@$(MAKE) -s -C tests/target clean
	rm -rf $(VENV) $(STAMPS) *.egg-info
