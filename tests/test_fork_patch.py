"""The vLLM fork patch against the pinned vLLM 0.33.0 sdist: hash, clean
apply, the probe header copy, where the sites are.  No compiler needed."""

import os
import re
import subprocess
import sys
import tarfile

import pytest

from fork import (BUILD_SCRIPT, FORK_DIR, PATCH, PROBES_H, ROOT, patch_files, patched_tree,
                  sdist_env, sdist_path, sha256)

SLOT_OPS = ("reshape_and_cache", "reshape_and_cache_flash", "concat_and_cache_mla")


@pytest.fixture(scope="module")
def tree():
    return patched_tree()


def host_function(source: str, name: str) -> str:
    """The body of the top-level function `void name(` in a C++ source."""
    m = re.search(rf"^void {name}\(", source, re.M)
    assert m, f"no function {name}"
    start = source.index("{", m.end())
    depth = 0
    for i in range(start, len(source)):
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            return source[start:i + 1]
    raise AssertionError(f"unbalanced braces in {name}")


def test_sdist_is_the_pinned_one():
    env = sdist_env()
    assert env["VLLM_VERSION"] == "0.33.0"
    assert env["SDIST_FILE"] == f"vllm-{env['VLLM_VERSION']}.tar.gz"
    assert re.fullmatch(r"[0-9a-f]{64}", env["SDIST_SHA256"])
    assert sha256(sdist_path()) == env["SDIST_SHA256"]
    # only these three: where to fetch it from is pip's index's business
    assert set(env) == {"VLLM_VERSION", "SDIST_FILE", "SDIST_SHA256"}


def test_no_registry_host_is_named_in_the_repository():
    # the names are spelled in two halves so that this file does not match
    hosts = ["python" + "hosted", "pypi" + r"\.org"]
    r = subprocess.run(["git", "grep", "-n", "-i", *(a for h in hosts for a in ("-e", h))],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == "", r.stdout


def test_sdist_url_resolves_through_a_configured_index(tmp_path):
    """sdist-url.py asks the index pip is told about, here a local PEP 503
    index (file://) given by PIP_INDEX_URL: the link it prints is that
    index's, whatever the default registry would say."""
    env = sdist_env()
    page = tmp_path / "simple" / "vllm"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        f'<a href="../../files/{env["SDIST_FILE"]}#sha256={env["SDIST_SHA256"]}">x</a>\n'
        '<a href="../../files/vllm-0.1.0.tar.gz">y</a>\n')
    r = subprocess.run([sys.executable, FORK_DIR / "sdist-url.py", "vllm", env["SDIST_FILE"]],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PIP_INDEX_URL": (tmp_path / "simple").as_uri(),
                            "PIP_EXTRA_INDEX_URL": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (tmp_path / "files" / env["SDIST_FILE"]).as_uri()


def test_patch_applies_cleanly_to_the_pristine_sdist(tmp_path):
    """git apply is strict (no fuzz): every file applies cleanly, the headers
    are new files, and nothing else (no CMake file) is touched."""
    files = patch_files()
    assert files == {
        "csrc/cache_kernels.cu": "modified",
        "csrc/cpu/cpu_attn.cpp": "modified",
        "csrc/kvtrace_cuda_sites.h": "added",
        "csrc/kvtrace_probes.h": "added",
    }
    top = f"vllm-{sdist_env()['VLLM_VERSION']}"
    with tarfile.open(sdist_path()) as tar:
        members = [tar.getmember(f"{top}/{f}") for f, how in files.items() if how == "modified"]
        tar.extractall(tmp_path, members)  # regular files, named above
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path))
    r = subprocess.run(["git", "apply", "-v", str(PATCH)], cwd=tmp_path / top, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for f in files:
        assert f"Applied patch {f} cleanly." in r.stderr, r.stderr


def test_header_copy_is_identical(tree):
    assert (tree / "csrc" / "kvtrace_probes.h").read_bytes() == PROBES_H.read_bytes()


def test_sites_sit_in_the_host_functions(tree):
    """Each op's host function tests its probe's semaphore before calling the
    site; the slot ops pass the op's stream (the device copy runs on it)."""
    cu = (tree / "csrc" / "cache_kernels.cu").read_text()
    for op in SLOT_OPS:
        body = host_function(cu, op)
        calls = re.findall(rf"if \(KVTRACE_ENABLED\({op}\)\)\s+kvtrace::{op}\(([^;]*)\);",
                           body)
        assert calls, op
        for args in calls:
            assert args.split(",")[0].strip() == "slot_mapping", (op, args)
            assert args.split(",")[-1].strip() == "stream", (op, args)
    swap = host_function(cu, "swap_blocks")
    assert re.search(r"if \(KVTRACE_ENABLED\(swap_blocks\) \|\| KVTRACE_ENABLED\(copy_blocks\)\)"
                     r"\s+kvtrace::swap_blocks\(memcpy_type, src, dst,", swap)
    batch = host_function(cu, "swap_blocks_batch")
    site = batch.index("kvtrace::swap_blocks_batch(src_data, dst_data, size_data, n)")
    assert site < batch.index("if (n == 0) return;"), "empty batches are calls too"
    cpu_src = (tree / "csrc" / "cpu" / "cpu_attn.cpp").read_text()
    cpu = host_function(cpu_src, "cpu_attn_reshape_and_cache")
    assert re.search(r"if \(KVTRACE_ENABLED\(cpu_attn_reshape_and_cache\)\)\s+"
                     r"KVTRACE_CPU_ATTN_RESHAPE_AND_CACHE\(\s*slot_mapping\.data_ptr<int64_t>\(\)",
                     cpu)


def test_read_site_sits_in_the_cpu_attention(tree):
    """vllm:block_table fires from cpu_attention_with_kv_cache, once, before
    the attention kernel runs, with the ABI's eight arguments in order
    (bpf/kvtrace_probes.h); key_cache is [num_blocks, num_kv_heads,
    block_size, head_size] there."""
    src = (tree / "csrc" / "cpu" / "cpu_attn.cpp").read_text()
    assert src.count("KVTRACE_BLOCK_TABLE(") == 1
    attn = host_function(src, "cpu_attention_with_kv_cache")
    m = re.search(r"if \(KVTRACE_ENABLED\(block_table\)\)\s+KVTRACE_BLOCK_TABLE\(([^;]*)\);",
                  attn)
    assert m
    args = [re.sub(r"\s+", "", a) for a in re.split(r",(?![^(]*\))", m[1])]
    assert args == [
        "block_table.data_ptr<int32_t>()", "block_table.stride(0)",
        "seq_lens.size(0)", "seq_lens.data_ptr<int32_t>()", "key_cache.size(2)",
        "reinterpret_cast<uintptr_t>(block_table.data_ptr())",
        "key_cache.size(0)", "reinterpret_cast<uintptr_t>(key_cache.data_ptr())"]
    # the layer id is the cache id its write op passes
    assert "reinterpret_cast<uintptr_t>(key_cache.data_ptr()), num_blocks" in src
    assert m.start() < attn.index("mainloop(&input)")


def test_build_script_usage():
    r = subprocess.run([str(BUILD_SCRIPT), "rocm"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "build-vllm-fork.sh cuda" in r.stderr
