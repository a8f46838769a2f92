set -u
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
K=/tmp/keepE; mkdir -p $K
export KVSTRATA_COMMIT=$(cat .ab/head_commit)
bash benchmarks/gpu_session.sh $K none >/dev/null; export PYTHONPATH=/tmp/site; echo "set up at $(el) s"
O=$K/formats; mkdir -p $O
for cell in "llama-3.1-70b-tp8 30720" "qwen2.5-7b 30720" "deepseek-v2-lite 15104"; do
  set -- $cell
  if [ $(el) -gt 170 ]; then echo "skipped $cell at $(el) s"; continue; fi
  FORMATS=sglang,trtllm WIDTHS=0,1,4,auto NEW=128,1024 CONCURRENCY="" REPS=3 POOL_GIB=0 CELL_TIMEOUT_S=70 \
    bash benchmarks/ttft_sweep.sh "$O" $1 $2 sleep; echo "  at $(el) s"
done
tar -czf $OUT/formatsE.tgz -C $K formats commit.txt gpu.txt; echo "total $(el) s"
