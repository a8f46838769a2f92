set -u
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
K=/tmp/keepD; mkdir -p $K
export KVSTRATA_COMMIT=$(cat .ab/head_commit)
bash benchmarks/gpu_session.sh $K none >/dev/null; export PYTHONPATH=/tmp/site; echo "set up at $(el) s"
S=$K/conc; mkdir -p $S
for cell in "llama-3.1-70b-tp8 4096" "qwen2.5-7b 4096"; do
  set -- $cell
  PLACEMENTS=engine,engine-paced FORMATS=vllm-LBNHC WIDTHS=0,4,auto NEW=128 CONCURRENCY=2,4,8,16 REPS=1 CONCURRENCY_REPS=2 \
    POOL_GIB=0 CELL_TIMEOUT_S=100 bash benchmarks/ttft_sweep.sh "$S" $1 $2 sleep; echo "  at $(el) s"
done
tar -czf $OUT/concD.tgz -C $K conc commit.txt gpu.txt
O=$K/one; mkdir -p $O
for cell in "qwen2.5-7b 30720" "deepseek-v2-lite 15104"; do
  set -- $cell
  if [ $(el) -gt 250 ]; then echo "skipped $cell at $(el) s"; continue; fi
  FORMATS=vllm-LBNHC WIDTHS=0,1,4,auto NEW=128,1024,4096 CONCURRENCY="" REPS=3 POOL_GIB=0 CELL_TIMEOUT_S=60 \
    bash benchmarks/ttft_sweep.sh "$O" $1 $2 sleep,spin; echo "  at $(el) s"
done
tar -czf $OUT/oneD.tgz -C $K one; echo "total $(el) s"
