# Session call 4 (tree: pending/plan-lead 7665cc5 as head; .ab/base = main 44431d7):
# 1) cold kernels (--warm-batch-sizes off), 16 requests of the 70B shard: base/head/head/base
# 2) the base with every batch size warmed, under torch.profiler: is the engine's stall gone?
# 3) warmed, the same A/B (the lead's cost where nothing waits for the context)
set -u
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
export KVSTRATA_COMMIT=$(cat .ab/head_commit)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader > "$OUT/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
python3 -c "from kvstrata.native import cuda_ext; cuda_ext.load()"; echo "built at $(el) s"
A="--shape llama-3.1-70b-tp8 --prefix 30720 --new 128 --formats vllm-LBNHC --placements engine --pool-gib 0 --engine-loop sleep --concurrency-new 256 --reps 1 --widths 0,4 --concurrency 16 --concurrency-reps 1"
summ() { for f in "$1"/*.json; do python3 -c "
import json,sys; d=json.load(open('$f')); c=d['formats']['vllm-LBNHC']['concurrency']['16']
print('$(basename $f)', {k: round(sum(v['mean_ttft_ms_per_rep'])/len(v['mean_ttft_ms_per_rep']),1) for k,v in c.items()},
      [s[:1]+[len(s[0])] for s in c['engine/w4']['steps_per_rep'][0]] if 'engine/w4' in c else '')" 2>&1 | cut -c1-400; done; }
RUN_TIMEOUT_S=100 bash benchmarks/tree_ab.sh .ab/base "$OUT/cold" cold benchmarks/ttft.py $A --warm-batch-sizes off; echo "cold A/B at $(el) s"; summ "$OUT/cold"
tar -czf "$OUT/cold.tgz" -C "$OUT" cold && rm -rf "$OUT/cold"
M=$(pwd)
(cd /tmp/ab-base && PYTHONPATH="/tmp/ab-base:$PYTHONPATH" TRACE_BENCH_DIR="$M/.ab/base/benchmarks" TRACE_TAG=warmed-base \
  KVSTRATA_COMMIT=$(cat "$M/.ab/base/.commit") timeout 120 python3 "$M/.ab/trace2.py" $A --out "$OUT/trace-warmed-base-run.json" > "$OUT/log-warmed-base.txt" 2>&1); echo "trace rc $? at $(el) s"
sed -n '2,3p;/^stream/p' "$OUT/trace-warmed-base.txt" | cut -c1-700
if [ $(el) -lt 230 ]; then
  RUN_TIMEOUT_S=100 bash benchmarks/tree_ab.sh .ab/base "$OUT/warm" warm benchmarks/ttft.py $A; echo "warm A/B at $(el) s"; summ "$OUT/warm"
fi
[ -d "$OUT/warm" ] && tar -czf "$OUT/warm.tgz" -C "$OUT" warm && rm -rf "$OUT/warm"
echo "total $(el) s"
