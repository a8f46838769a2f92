# Sweep call A: one request, every required shape, prefixes ~4k to ~30k, new 128/1024/4096, sleep and spin loops.
set -u
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
export KVSTRATA_COMMIT=$(cat .ab/head_commit)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader > "$OUT/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
python3 -c "from kvstrata.native import cuda_ext; cuda_ext.load()"; echo "built at $(el) s"
S="$OUT/sweep"; mkdir -p "$S"
export FORMATS=vllm-LBNHC WIDTHS=0,1,4,auto NEW=128,1024,4096 CONCURRENCY="" REPS=3 POOL_GIB=0 CELL_TIMEOUT_S=80
for cell in "llama-3.1-70b-tp8 4096,30720 sleep,spin" "qwen2.5-7b 4096,30720 sleep,spin" "deepseek-v2-lite 4096,15104 sleep,spin"; do
  set -- $cell
  if [ $(el) -gt 470 ]; then echo "skipped $cell at $(el) s"; continue; fi
  bash benchmarks/ttft_sweep.sh "$S" $1 $2 $3
  echo "  at $(el) s"
done
if [ $(el) -lt 480 ]; then FORMATS=vllm-LBNHC,sglang,trtllm bash benchmarks/ttft_sweep.sh "$S" llama-3.1-8b 15104 sleep; fi
python3 benchmarks/ttft_sweep_table.py "$S" --out "$S/table.md" >/dev/null 2>&1; sed -n '/One request/,/^## Req/p' "$S/table.md" | cut -c1-260
tar -czf "$OUT/sweep.tgz" -C "$OUT" sweep && rm -rf "$S"
echo "total $(el) s"
