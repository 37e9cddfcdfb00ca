"""The vLLM fork patches, one per release of scripts/vllm-releases.txt,
against their pinned sdists: hash, clean apply, the probe header copy, where
the sites are.  No compiler needed."""

import os
import re
import subprocess
import sys
import tarfile

import pytest

from fork import (BUILD_SCRIPT, FORK_DIR, PROBES_H, RELEASES, ROOT, patch_files, patch_path,
                  patched_tree, pinned_releases, sdist_path, sha256)

SLOT_OPS = ("reshape_and_cache", "reshape_and_cache_flash", "concat_and_cache_mla")
# A kernel launch in a slot op's host function: the dtype dispatch macro or
# the NVFP4 launchers (their extern declarations start with `extern`).
LAUNCH = re.compile(r"^\s+(?:DISPATCH_BY_KV_CACHE_DTYPE|reshape_and_cache_nvfp4_dispatch"
                    r"|vllm::launch_\w+)\(", re.M)


@pytest.fixture(scope="module", params=RELEASES)
def release(request):
    return request.param


@pytest.fixture(scope="module")
def tree(release):
    return patched_tree(release)


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


def test_every_release_has_a_patch_and_every_patch_a_release():
    """Adding a release is its line in scripts/vllm-releases.txt and its
    patch, nothing else: no other pin of a release is kept."""
    assert {"0.33.0", "0.34.0"} <= set(RELEASES)
    dirs = {p.name for p in FORK_DIR.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert dirs == set(RELEASES)
    for release in RELEASES:
        assert patch_path(release).is_file(), release
    assert not (FORK_DIR / "sdist.env").exists()
    assert not (FORK_DIR / "kvtrace-probes.patch").exists()


def test_sdist_is_the_pinned_one(release):
    pinned = pinned_releases()[release]
    assert re.fullmatch(r"[0-9a-f]{64}", pinned)
    sdist = sdist_path(release)
    assert sdist.name == f"vllm-{release}.tar.gz"
    assert sha256(sdist) == pinned


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
    release = RELEASES[-1]
    sdist = f"vllm-{release}.tar.gz"
    page = tmp_path / "simple" / "vllm"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        f'<a href="../../files/{sdist}#sha256={pinned_releases()[release]}">x</a>\n'
        '<a href="../../files/vllm-0.1.0.tar.gz">y</a>\n')
    r = subprocess.run([sys.executable, FORK_DIR / "sdist-url.py", "vllm", sdist],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PIP_INDEX_URL": (tmp_path / "simple").as_uri(),
                            "PIP_EXTRA_INDEX_URL": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (tmp_path / "files" / sdist).as_uri()


def test_patch_applies_cleanly_to_the_pristine_sdist(release, tmp_path):
    """git apply is strict (no fuzz): every file applies cleanly, the headers
    are new files, and nothing else (no CMake file) is touched."""
    files = patch_files(release)
    assert files == {
        "csrc/cache_kernels.cu": "modified",
        "csrc/cpu/cpu_attn.cpp": "modified",
        "csrc/kvtrace_cuda_sites.h": "added",
        "csrc/kvtrace_probes.h": "added",
    }
    top = f"vllm-{release}"
    with tarfile.open(sdist_path(release)) as tar:
        members = [tar.getmember(f"{top}/{f}") for f, how in files.items() if how == "modified"]
        tar.extractall(tmp_path, members)  # regular files, named above
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path))
    r = subprocess.run(["git", "apply", "-v", str(patch_path(release))], cwd=tmp_path / top,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for f in files:
        assert f"Applied patch {f} cleanly." in r.stderr, r.stderr


def test_site_header_is_the_same_for_every_release():
    """The sites' logic (kvtrace_cuda_sites.h) is the same file in every
    patch, so that a fix to it reaches every release (docs/fork.md)."""
    sites = {r: (patched_tree(r) / "csrc" / "kvtrace_cuda_sites.h").read_bytes()
             for r in RELEASES}
    assert len(set(sites.values())) == 1, sorted(sites)


def test_header_copy_is_identical(tree):
    assert (tree / "csrc" / "kvtrace_probes.h").read_bytes() == PROBES_H.read_bytes()


def test_sites_sit_in_the_host_functions(tree):
    """Each op's host function tests its probe's semaphore before calling the
    site; the slot ops pass the op's stream (the device copy runs on it)."""
    cu = (tree / "csrc" / "cache_kernels.cu").read_text()
    for op in SLOT_OPS:
        body = host_function(cu, op)
        sites = list(re.finditer(
            rf"if \(KVTRACE_ENABLED\({op}\)\)\s+kvtrace::{op}\(([^;]*)\);", body))
        assert sites, op
        for site in sites:
            args = site[1]
            assert args.split(",")[0].strip() == "slot_mapping", (op, args)
            assert args.split(",")[-1].strip() == "stream", (op, args)
        # every launch path has its own site, after the path's own checks
        # and right before its launch (a path that throws fires nothing)
        launches = [m.start() for m in LAUNCH.finditer(body)]
        assert len(launches) == len(sites), (op, len(launches), len(sites))
        for site, launch in zip(sites, launches):
            between = body[site.end():launch]
            assert site.end() < launch and not LAUNCH.search(between), op
            assert "STD_TORCH_CHECK" not in between, (op, between)
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


def test_flash_site_covers_the_asymmetric_kernel(release, tree):
    """From 0.34.0 reshape_and_cache_flash launches a second kernel when V's
    head size differs from K's; its launch has a site of its own."""
    body = host_function((tree / "csrc" / "cache_kernels.cu").read_text(),
                         "reshape_and_cache_flash")
    if release == "0.33.0":
        assert "CALL_RESHAPE_AND_CACHE_FLASH_ASYM" not in body
        return
    asym = body.index("CALL_RESHAPE_AND_CACHE_FLASH_ASYM")
    branch = body.rindex("} else {", 0, asym)
    assert "if (v_head_size == head_size) {" in body[:branch]
    assert "kvtrace::reshape_and_cache_flash(" in body[branch:asym]


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
    assert "default: the\nnewest release" in r.stderr


def test_build_script_refuses_a_release_outside_the_matrix(tmp_path):
    r = subprocess.run([str(BUILD_SCRIPT), "source", "0.1.0", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "build-vllm-fork: vLLM 0.1.0 is not in scripts/vllm-releases.txt "
        f"({' '.join(sorted(RELEASES, key=lambda v: tuple(map(int, v.split('.')))))})"]
    assert list(tmp_path.iterdir()) == []


def test_build_script_defaults_to_the_newest_release(tmp_path):
    newest = max(RELEASES, key=lambda v: tuple(map(int, v.split("."))))
    r = subprocess.run([str(BUILD_SCRIPT), "source", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / f"vllm-{newest}")
