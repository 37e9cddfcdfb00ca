"""The probe-file cache: files known to have no USDT probes of a provider,
kept across runs in the tracer's cache directory (cache.py).
"""

from .. import cache

# Files known to have no USDT probes of a provider, across runs: parsing the
# hundreds of libraries a vLLM process maps (torch's are large) takes seconds
# with pyelftools, and almost none of them have probes.  Keyed by path,
# device, inode, size and change times, so any change to a file parses it again.
_KNOWN = {}


def _name(provider: str) -> str:
    return f"no-usdt-{provider}.json"


def file_ident(path: str, st) -> str:
    return f"{path}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def known(provider: str) -> dict:
    if provider not in _KNOWN:
        _KNOWN[provider] = {"files": set(cache.load(_name(provider)) or []),
                           "dirty": False}
    return _KNOWN[provider]


def save(provider: str, mine: set):
    """Store the provider's set if it changed; past 50,000 files it keeps
    only `mine`, the files the process at hand maps (a bound)."""
    entry = known(provider)
    if entry["dirty"]:
        if len(entry["files"]) > 50000:
            entry["files"] = mine
        cache.store(_name(provider), sorted(entry["files"]))
        entry["dirty"] = False
