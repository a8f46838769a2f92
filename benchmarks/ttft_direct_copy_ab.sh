#!/usr/bin/env bash
# A/B on first-token time: engine-placement copies into SGLang's per-layer buffers written directly by the copy
# engine, against copies through staging buffers and the scatter kernel (vLLM's LBNHC as the control, which
# always stages). Both arms force the choice for every CudaTransferConfig in the benchmark process (the
# engine-placement side); the server process keeps its own default. Run on the GPU machine from the repository
# root (with the pyzmq wheel in .whl/): bash benchmarks/ttft_direct_copy_ab.sh; results in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
python3 -c "from kvstrata.native import cuda_ext; cuda_ext.load()"
cd benchmarks
A="${TTFT_AB_ARGS:---formats sglang,vllm-LBNHC --placements server,worker --new 1024 --concurrency= --reps 3 --pool-gib 4 --widths 0,1,2}"
for arm in direct staged; do
  timeout 200 python3 -c "
import sys, kvstrata.native.cuda_executor as ce
run = 256 << 10 if sys.argv[1] == 'direct' else ce.NO_DIRECT_COPIES
Orig = ce.CudaTransferConfig
ce.CudaTransferConfig = lambda *a, **k: Orig(*a, **{**k, 'direct_copy_min_run': run})
import ttft; sys.exit(ttft.main(sys.argv[2:]))
" $arm $A --out "$OUT/$arm.json" > "$OUT/$arm.txt" 2>&1
done
python3 - <<'PY'
import json, os
for n in ("direct", "staged"):
    r = json.load(open(os.path.join(os.environ["OUT"], n + ".json")))
    print(n, r["errors"].keys())
    for f, fr in r["formats"].items():
        a = fr["concurrency_1"]["1024"]
        print(" ", f, {k: (v["ttft_ms"]["median"], v.get("transfer_ms", {}).get("median")) for k, v in a.items()})
PY
