# Call 1: native staged-slice writer (working tree) against 37a2b75 (base), on one GPU.
set -u
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
K=/tmp/keep; mkdir -p $K
export KVSTRATA_COMMIT=$(cat .ab/head_commit)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader > $K/gpu.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
python3 -c "from kvstrata.native import cuda_ext; cuda_ext.load()"; echo "head built at $(el) s"
timeout 200 python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider --timeout 60 > $K/gpu-tests.log 2>&1; echo "tests rc $? at $(el) s"; tail -2 $K/gpu-tests.log
grep -n "Error\|FAILED" $K/gpu-tests.log | head -8
RUN_TIMEOUT_S=110 bash benchmarks/tree_ab.sh .ab/base $K transfer-8b benchmarks/transfer.py --modes staged --reps 15 \
  --skip rawzmq,inprocess,server,locate_ab,sglang_offload; echo "transfer-8b at $(el) s"
if [ $(el) -lt 400 ]; then
RUN_TIMEOUT_S=60 bash benchmarks/tree_ab.sh .ab/base $K ttft-70b-30720 benchmarks/ttft.py --shape llama-3.1-70b-tp8 --prefix 30720 \
  --new 128 --formats vllm-LBNHC --widths 0,1,4 --placements engine --concurrency "" --reps 5 --pool-gib 0 --engine-loop sleep
echo "ttft-70b at $(el) s"; fi
python3 benchmarks/ab_table.py $K > $K/table.txt 2>&1; head -c 5000 $K/table.txt
cp $K/table.txt $K/gpu-tests.log $K/gpu.txt $OUT/; tar -czf $OUT/call1.tgz -C $K . ; echo "total $(el) s"
