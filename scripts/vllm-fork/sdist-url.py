#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""sdist-url.py PROJECT FILE - the URL of a release file on pip's indexes.

Prints the first URL (or file:// path) where FILE is found, asking, in
pip's own order, the index pip is configured with (PIP_INDEX_URL, else
index-url in pip's config, else pip's built-in default, read from pip
itself), then each extra index (PIP_EXTRA_INDEX_URL / extra-index-url), then
the find-links locations.  Each index is read through its simple API page
(PEP 503), so a mirror or a local file:// index serves as well as the
registry.  `pip download --no-binary :all:` would resolve the same URL, but
it then prepares vLLM's metadata, which needs torch and a CUDA toolchain.

Exit 0 with the URL on stdout; 1 (one line on stderr) when no index has it.
The caller checks the sha256 of what it fetches."""

import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request


def pip_config() -> dict:
    """{key: value} from `pip config list` (global, user, site and env)."""
    r = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                       capture_output=True, text=True)
    out = {}
    for line in r.stdout.splitlines():
        key, _, value = line.partition("=")
        out[key.rsplit(".", 1)[-1]] = value.strip().strip("'\"")
    return out


def setting(config: dict, name: str) -> list:
    value = os.environ.get("PIP_" + name.upper().replace("-", "_")) or config.get(name, "")
    return value.split()


def default_index() -> str:
    from pip._internal.models.index import PyPI  # pip's own default, not ours
    return PyPI.simple_url


def links(url: str) -> list:
    """(absolute URL without its #fragment, file name) of every link on a page."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file" and os.path.isdir(urllib.parse.unquote(parsed.path)):
        url += "index.html"  # a local index, as pip reads it
    with urllib.request.urlopen(url, timeout=60) as r:
        page = r.read().decode(errors="replace")
        base = r.geturl()
    out = []
    for href in re.findall(r'href\s*=\s*["\']([^"\']+)["\']', page, re.I):
        absolute = urllib.parse.urljoin(base, href.split("#", 1)[0])
        out.append((absolute, urllib.parse.unquote(absolute.rstrip("/").rsplit("/", 1)[-1])))
    return out


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: sdist-url.py PROJECT FILE", file=sys.stderr)
        return 2
    project, wanted = sys.argv[1], sys.argv[2]
    name = re.sub(r"[-_.]+", "-", project).lower()  # PEP 503 normalized
    config = pip_config()
    indexes = setting(config, "index-url") or [default_index()]
    indexes += setting(config, "extra-index-url")
    tried = []
    for index in indexes:
        page = index.rstrip("/") + f"/{name}/"
        try:
            for url, file_name in links(page):
                if file_name == wanted:
                    print(url)
                    return 0
        except (OSError, ValueError) as e:
            tried.append(f"{page} ({getattr(e, 'reason', e)})")
            continue
        tried.append(page)
    for place in setting(config, "find-links"):
        if "://" not in place and os.path.isfile(os.path.join(place, wanted)):
            print("file://" + os.path.abspath(os.path.join(place, wanted)))
            return 0
        tried.append(place)
    print(f"sdist-url: {wanted} is on none of pip's indexes: {', '.join(tried)}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
