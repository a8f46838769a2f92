#!/usr/bin/env bash
# Does busy polling pay for itself? First-token time under compute (benchmarks/ttft.py), every arm checked
# byte-exact, one model shape (Llama-3.1-8B layers, vLLM's layout), with the server's defaults and with
# --busy-poll-ms 0, in the order defaults, off, off, defaults. The other latency mechanisms this script measured
# (rings, mailbox, deferred replies, turn hand-over, kernel mode, round-robin) were removed on its figures:
# docs/decisions.md; the script that measured them is this file at commit d421ace.
# Summarize with `python benchmarks/mechanisms_summary.py OUT_DIR`.
#   bash benchmarks/mechanisms_ab.sh OUT_DIR
set -u
out="${1:-${OUT:-/tmp/mechanisms-ab}}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
echo "${KVSTRATA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" > "$out/commit.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt"
python3 -c "from kvstrata.native import cuda_ext; cuda_ext.load()" || exit 1
common=(--formats vllm-LBNHC --prefix 15104 --new 1024 --widths 0,1 --concurrency 4 --reps 4 --concurrency-reps 2
        --pool-gib 10 ${AB_ARGS:-})
run() {  # name, then ttft.py arguments
  local name=$1; shift
  timeout "${RUN_TIMEOUT_S:-90}" python3 benchmarks/ttft.py "${common[@]}" "$@" --out "$out/$name.json" \
    > "$out/$name.txt" 2>&1 || echo "$name: exit $?"
  echo "$name done at $(date +%T)"
}
flags=("defaults:" "no-busy-poll:--busy-poll-ms 0")
order=(0 1 1 0)
for n in "${!order[@]}"; do
  f=${flags[${order[$n]}]}
  run "flags-$n-${f%%:*}" --placements server,engine "--server-args=${f#*:}"
done
