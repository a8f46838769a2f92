# Call 1 (asked for an H200, an H100 came): GPU tests, transfer.py (raw and engine placement), one request at 30,720 / 15,104 tokens.
set -u
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
K=/tmp/keep1; mkdir -p $K
export KVSTRATA_COMMIT=$(cat .ab/head_commit)
bash benchmarks/gpu_session.sh $K none; export PYTHONPATH=/tmp/site; echo "set up at $(el) s"
timeout 150 python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider --timeout 60 > $K/gpu-tests.log 2>&1; echo "tests rc $? at $(el) s"; tail -2 $K/gpu-tests.log
grep -n "Error\|FAILED" $K/gpu-tests.log | head -8
timeout 100 python3 benchmarks/transfer.py --modes staged --reps 15 --skip rawzmq,inprocess,server,locate_ab,sglang_offload \
  --out $K/transfer.json > $K/transfer.txt 2>&1; echo "transfer rc $? at $(el) s"; tail -14 $K/transfer.txt
S=$K/sweep; mkdir -p $S
export FORMATS=vllm-LBNHC WIDTHS=0,1,4,auto NEW=128,1024,4096 CONCURRENCY="" REPS=3 POOL_GIB=0 CELL_TIMEOUT_S=75
for cell in "llama-3.1-70b-tp8 30720 sleep,spin" "qwen2.5-7b 30720 sleep,spin" "deepseek-v2-lite 15104 sleep,spin"; do
  set -- $cell
  if [ $(el) -gt 500 ]; then echo "skipped $cell at $(el) s"; continue; fi
  bash benchmarks/ttft_sweep.sh "$S" $1 $2 $3; echo "  at $(el) s"
done
python3 benchmarks/ttft_sweep_table.py "$S" --out "$S/table.md" >/dev/null 2>&1; sed -n '/One request/,/^## Req/p' "$S/table.md" | cut -c1-240
cp $K/gpu-tests.log $K/transfer.txt $K/gpu.txt $OUT/ 2>/dev/null; tar -czf $OUT/call1.tgz -C $K . ; echo "total $(el) s"
