#!/usr/bin/env bash
# The seed questions' figures (docs/findings.md), made again: real vLLM on the
# CPU (the tiny model, dummy weights, the plugin tier from make setup) recorded
# under five workloads, and report's pictures of them, alone and in pairs.
#
#   short       16 prompts of 24 tokens, 32 generated each
#   long        16 prompts of 400 tokens, 32 generated each
#   prefix-off  16 prompts of 256 tokens sharing their first 192, twice
#   prefix-on   the same with prefix caching on
#   preempt     3 long requests in a 10-block cache: vLLM must preempt
#
# Recordings, pages and every figure go to WORK (build/findings); the figures
# docs/findings.md shows are copied to OUT (docs/findings), small PNGs, with
# the headline tables of the two pairs.  FINDINGS_RUNS="NAME ..." records only
# those workloads (a pair is drawn when both of it are there);
# FINDINGS_KEEP=1 draws again from the recordings already in WORK.
# Needs root (it records).  usage: scripts/findings.sh [OUT] [WORK]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
out=${1:-docs/findings}
work=${2:-build/findings}
runs=${FINDINGS_RUNS:-short long prefix-off prefix-on preempt}
model=build/tiny-llama
kv=(.venv/bin/python -m tracer.cli)
mkdir -p "$out" "$work"
.venv/bin/python scripts/make-tiny-model.py "$model" >/dev/null

reqs() {  # reqs N PROMPT GEN: N requests of PROMPT tokens, GEN generated
    local i s=""
    for ((i = 0; i < $1; i++)); do s+="${s:+,}$2:$3"; done
    echo "$s"
}

flags() {  # the workload's flags (scripts/vllm-workload.py)
    case $1 in
        short) echo --requests "$(reqs 16 24 32)" ;;
        long) echo --requests "$(reqs 16 400 32)" ;;
        prefix-off) echo --requests "$(reqs 16 256 16)" --shared-prefix 192 --repeat 2 \
            --prefix-caching off ;;
        prefix-on) echo --requests "$(reqs 16 256 16)" --shared-prefix 192 --repeat 2 \
            --prefix-caching on ;;
        preempt) echo --requests 200:40,150:40,120:40 --num-gpu-blocks 10 --max-model-len 256 ;;
        *) echo "findings: no workload $1" >&2; exit 1 ;;
    esac
}

for name in $runs; do
    if [[ ${FINDINGS_KEEP:-0} == 1 && -s $work/$name.kvt ]]; then
        continue
    fi
    echo "findings: recording $name" >&2
    # shellcheck disable=SC2046  # flags() words are split on purpose
    "${kv[@]}" record -o "$work/$name.kvt" -- env VLLM_PLUGINS=kvtrace \
        .venv-vllm/bin/python scripts/vllm-workload.py --model "$model" --block-size 32 \
        --seed 0 --out "$work/$name.out.json" $(flags "$name") >"$work/$name.log" 2>&1 ||
        { tail -20 "$work/$name.log" >&2; exit 1; }
done

for name in $runs; do
    echo "findings: drawing $name" >&2
    "${kv[@]}" report "$work/$name.kvt" --html "$work/$name.html" --png "$work/$name"
    "${kv[@]}" report "$work/$name.kvt" --format json >"$work/$name.json"
done
for pair in short:long prefix-off:prefix-on; do
    a=${pair%:*} b=${pair#*:}
    [[ " $runs " == *" $a "* && " $runs " == *" $b "* ]] || continue
    echo "findings: drawing $a beside $b" >&2
    COLUMNS=100 "${kv[@]}" report "$work/$a.kvt" "$work/$b.kvt" --html "$work/$a-vs-$b.html" \
        --png "$work/$a-vs-$b" >"$work/$a-vs-$b.txt"
    for fig in fill access_frequency utilization_over_time heatmap_reads; do
        cp "$work/$a-vs-$b/$fig.png" "$out/$a-vs-$b-$fig.png"
    done
    cp "$work/$a-vs-$b.txt" "$out/"
done
if [[ " $runs " == *" preempt "* ]]; then
    for fig in fill access_frequency request_timeline heatmap_writes; do
        cp "$work/preempt/$fig.png" "$out/preempt-$fig.png"
    done
fi
if [[ " $runs " == *" prefix-on "* ]]; then
    cp "$work/prefix-on/miss_ratio_curve.png" "$out/prefix-on-miss_ratio_curve.png"
fi
echo "findings: figures in $out, recordings and pages in $work" >&2
