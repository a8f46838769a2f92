# Sweep call B: 2-16 requests arriving together (256 new tokens each), every batch size warmed first; chunk-major,
# width 4, auto, and width 4 served one after another; then the GPU tests.
set -u
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
export KVSTRATA_COMMIT=$(cat .ab/head_commit)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader > "$OUT/gpu.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
python3 -c "from kvstrata.native import cuda_ext; cuda_ext.load()"; echo "built at $(el) s"
S="$OUT/sweep"; mkdir -p "$S"
export FORMATS=vllm-LBNHC WIDTHS=0,4,auto SERIAL_WIDTHS=4 NEW=128 CONCURRENCY=2,4,8,16 REPS=1 CONCURRENCY_REPS=2 POOL_GIB=0 CELL_TIMEOUT_S=110
for cell in "llama-3.1-70b-tp8 30720" "qwen2.5-7b 30720" "deepseek-v2-lite 15104" "llama-3.1-70b-tp8 4096" "qwen2.5-7b 4096"; do
  set -- $cell
  if [ $(el) -gt 400 ]; then echo "skipped $cell at $(el) s"; continue; fi
  bash benchmarks/ttft_sweep.sh "$S" $1 $2 sleep
  echo "  at $(el) s"
done
python3 benchmarks/ttft_sweep_table.py "$S" --out "$S/table.md" >/dev/null 2>&1; sed -n '/^## Req/,/^## A spin/p' "$S/table.md" | cut -c1-300
tar -czf "$OUT/sweep.tgz" -C "$OUT" sweep && rm -rf "$S"
mkdir -p /tmp/keep && cp "$OUT"/* /tmp/keep/
echo "total $(el) s"
