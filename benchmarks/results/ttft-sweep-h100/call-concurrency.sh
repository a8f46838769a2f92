# Call 2 (the same H100, held): 2-16 requests, chunk-major served one after another and submitted together, width 4 both ways, auto.
set -u
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
K=/tmp/keep2; mkdir -p $K
export KVSTRATA_COMMIT=$(cat .ab/head_commit)
bash benchmarks/gpu_session.sh $K none; export PYTHONPATH=/tmp/site; echo "set up at $(el) s"
S=$K/conc; mkdir -p $S
export FORMATS=vllm-LBNHC WIDTHS=0,4,auto SERIAL_WIDTHS=4 CHUNK_MAJOR_TOGETHER=1 NEW=128 CONCURRENCY=2,4,8,16 REPS=1 CONCURRENCY_REPS=2 POOL_GIB=0 CELL_TIMEOUT_S=150
for cell in "llama-3.1-70b-tp8 30720" "qwen2.5-7b 30720" "deepseek-v2-lite 15104" "llama-3.1-70b-tp8 4096" "qwen2.5-7b 4096"; do
  set -- $cell
  if [ $(el) -gt 440 ]; then echo "skipped $cell at $(el) s"; continue; fi
  bash benchmarks/ttft_sweep.sh "$S" $1 $2 sleep; echo "  at $(el) s"
done
python3 benchmarks/ttft_sweep_table.py "$S" --out "$S/table.md" >/dev/null 2>&1; sed -n '/^## Requests/,/^## A spin/p' "$S/table.md" | cut -c1-330
cp $K/gpu.txt $OUT/ 2>/dev/null; tar -czf $OUT/call2.tgz -C $K . ; echo "total $(el) s"
