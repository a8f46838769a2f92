#!/usr/bin/env bash
# A/B on first-token time: engine-executed loads whose pieces split across two copy streams (-copystreams2)
# against one copy stream. Which engine-executed arm of a run loads slowly under compute follows the order of the
# arms' first transfers (results/h200-2026-12-03-session12), so each setting has two identical arms, placed so that
# each setting holds one of the slow positions in either first-use order, and both orders run.
# Run on the GPU machine from the repository root (pyzmq wheel in .whl/): bash benchmarks/copy_streams_ab.sh DIR
set -u
out="${1:-$OUT}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || exit 1
python3 -c "from kvstrata.native import cuda_ext; cuda_ext.load()" || exit 1
# idle GPU: one pinned 1 GiB host-to-device copy on one stream, against the same bytes halved onto two streams
python3 - <<'PY' | tee "$out/raw.txt"
import torch
n = 1 << 30
src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
streams = [torch.cuda.Stream() for _ in range(2)]
def timed(parts):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    cur = torch.cuda.current_stream()
    step = n // parts
    for i in range(parts):
        streams[i].wait_stream(cur)
        with torch.cuda.stream(streams[i]):
            dst[i * step:(i + 1) * step].copy_(src[i * step:(i + 1) * step], non_blocking=True)
        cur.wait_stream(streams[i])
    end.record(); end.synchronize()
    return start.elapsed_time(end)
for parts in (1, 2, 1, 2):
    timed(parts)
for parts in (1, 2):
    ms = sorted(timed(parts) for _ in range(7))[3]
    print(f"raw H2D 1 GiB on {parts} stream(s): {ms:.2f} ms, {n / ms / 1e6:.1f} GB/s (median of 7)")
PY
arms="${AB_ARMS:-server,worker,worker-copystreams2,worker-copystreams2-twin1,worker-twin1}"
for fmt in ${AB_FORMATS:-trtllm vllm-LBNHC sglang}; do
  for order in placements reversed; do
    timeout 200 python3 benchmarks/ttft.py --formats "$fmt" --new "${AB_NEW:-256}" --widths 0,1 --placements "$arms" \
      --concurrency= --reps "${AB_REPS:-5}" --pool-gib 16 --first-use "$order" \
      --out "$out/ab-$fmt-$order.json" > "$out/ab-$fmt-$order.txt" 2>&1 || echo "ttft.py $fmt $order failed"
  done
done
python3 benchmarks/copy_streams_summary.py "$out"/ab-*.json
