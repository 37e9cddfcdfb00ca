"""The C extension kvtrace_vllm._probes: the probe sites of bpf/kvtrace_probes.h
(the repository's one copy of the header, found relative to this file)."""
import os

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# relative to this directory, as setuptools wants; the header is never copied
BPF_INCLUDE = os.path.relpath(os.path.join(HERE, "..", "bpf"), HERE)
if not os.path.exists(os.path.join(HERE, BPF_INCLUDE, "kvtrace_probes.h")):
    raise SystemExit(f"kvtrace_probes.h not found in {os.path.join(HERE, BPF_INCLUDE)}: "
                     "build the plugin from the kvtrace-bpf repository's plugin/ directory")

setup(
    ext_modules=[
        Extension(
            "kvtrace_vllm._probes",
            sources=["kvtrace_vllm/_probes.c"],
            include_dirs=[BPF_INCLUDE],
            depends=[os.path.join(BPF_INCLUDE, "kvtrace_probes.h")],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
        ),
        # the install outcome, in an object with no probe (_status.c)
        Extension(
            "kvtrace_vllm._status",
            sources=["kvtrace_vllm/_status.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
        ),
    ],
)
