# Call 3 (the same H100, held): one request at 4,096 tokens (5 repetitions) and Llama-3.1-8B in three formats (3).
set -u
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
K=/tmp/keep3; mkdir -p $K
export KVSTRATA_COMMIT=$(cat .ab/head_commit)
bash benchmarks/gpu_session.sh $K none; export PYTHONPATH=/tmp/site; echo "set up at $(el) s"
echo tests skipped

echo transfer skipped

S=$K/sweep; mkdir -p $S
export FORMATS=vllm-LBNHC WIDTHS=0,1,4,auto NEW=128,1024,4096 CONCURRENCY="" REPS=5 POOL_GIB=0 CELL_TIMEOUT_S=110
for cell in "llama-3.1-70b-tp8 4096 sleep,spin" "qwen2.5-7b 4096 sleep,spin" "deepseek-v2-lite 4096 sleep,spin"; do
  set -- $cell
  if [ $(el) -gt 500 ]; then echo "skipped $cell at $(el) s"; continue; fi
  bash benchmarks/ttft_sweep.sh "$S" $1 $2 $3; echo "  at $(el) s"
done
if [ $(el) -lt 420 ]; then REPS=3 FORMATS=vllm-LBNHC,sglang,trtllm bash benchmarks/ttft_sweep.sh "$S" llama-3.1-8b 15104 sleep; fi
python3 benchmarks/ttft_sweep_table.py "$S" --out "$S/table.md" >/dev/null 2>&1; sed -n '/One request/,/^## Req/p' "$S/table.md" | cut -c1-240
cp $K/gpu-tests.log $K/transfer.txt $K/gpu.txt $OUT/ 2>/dev/null; tar -czf $OUT/call3.tgz -C $K . ; echo "total $(el) s"
