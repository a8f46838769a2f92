# One call: GPU tests; 2-16 requests together, engine placement as is and with pace_loads (engine-paced);
# transfer.py; then one request at 30,720 / 15,104 tokens while time is left.
set -u
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
K=/tmp/keepC; mkdir -p $K
export KVSTRATA_COMMIT=$(cat .ab/head_commit)
bash benchmarks/gpu_session.sh $K none; export PYTHONPATH=/tmp/site; echo "set up at $(el) s"
timeout 150 python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider --timeout 60 > $K/gpu-tests.log 2>&1; echo "tests rc $? at $(el) s"; tail -2 $K/gpu-tests.log
grep -n "Error\|FAILED" $K/gpu-tests.log | head -8
S=$K/conc; mkdir -p $S
for cell in "llama-3.1-70b-tp8 30720" "qwen2.5-7b 30720" "deepseek-v2-lite 15104" "llama-3.1-70b-tp8 4096" "qwen2.5-7b 4096"; do
  set -- $cell
  if [ $(el) -gt 330 ]; then echo "skipped $cell at $(el) s"; continue; fi
  PLACEMENTS=engine,engine-paced FORMATS=vllm-LBNHC WIDTHS=0,4,auto NEW=128 CONCURRENCY=2,4,8,16 REPS=1 CONCURRENCY_REPS=2 \
    POOL_GIB=0 CELL_TIMEOUT_S=120 bash benchmarks/ttft_sweep.sh "$S" $1 $2 sleep; echo "  at $(el) s"
done
python3 benchmarks/ttft_sweep_table.py "$S" --out "$S/table.md" >/dev/null 2>&1; sed -n '/The targets/,/^## One request:/p;/^## Requests/,/^## A spin/p' "$S/table.md" | cut -c1-230
tar -czf $OUT/conc.tgz -C $K conc gpu-tests.log gpu.txt commit.txt
if [ $(el) -lt 420 ]; then timeout 60 python3 benchmarks/transfer.py --modes staged --reps 15 --skip rawzmq,inprocess,server,locate_ab,sglang_offload \
  --out $K/transfer.json > $K/transfer.txt 2>&1; echo "transfer rc $? at $(el) s"; tail -12 $K/transfer.txt; fi
O=$K/one; mkdir -p $O
for cell in "llama-3.1-70b-tp8 30720" "qwen2.5-7b 30720" "deepseek-v2-lite 15104"; do
  set -- $cell
  if [ $(el) -gt 420 ]; then echo "skipped $cell at $(el) s"; continue; fi
  FORMATS=vllm-LBNHC WIDTHS=0,1,4,auto NEW=128,1024,4096 CONCURRENCY="" REPS=3 POOL_GIB=0 CELL_TIMEOUT_S=80 \
    bash benchmarks/ttft_sweep.sh "$O" $1 $2 sleep,spin; echo "  at $(el) s"
done
python3 benchmarks/ttft_sweep_table.py "$O" --out "$O/table.md" >/dev/null 2>&1; sed -n '/The targets/,/^## One request:/p' "$O/table.md" | cut -c1-200
tar -czf $OUT/rest.tgz -C $K one transfer.json transfer.txt 2>/dev/null; echo "total $(el) s"
