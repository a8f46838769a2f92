#!/usr/bin/env bash
# A/B on first-token time and on the compute beside a load: the engine-placement scatter kernel's stores to the
# engine's cache kept in L2 (__stcg, the code as it is) against streaming stores (__stcs: evicted first), which
# would leave the compute's own lines in L2. The store is compiled in, so each arm is its own process with its
# own build of the extension; the arms run A B B A, each a ttft.py run of one request with --interference, for
# the 8B shape at 15,104 tokens and the 70B shard at 4,096. native/csrc/kernels.cu is edited for the B arms and
# restored on exit. Run on the GPU machine from the repository root (with the pyzmq wheel in .whl/):
#   bash benchmarks/scatter_stores_ab.sh       # results in $OUT: <arm>-<shape>.json, then a summary
set -u
out="${OUT:?set OUT}"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
kernels=native/csrc/kernels.cu
grep -q "__stcg(reinterpret_cast<V\*>(out\[u\]), buf\[u\]);" "$kernels" || { echo "the scatter store is not where this script expects it"; exit 2; }
cp "$kernels" /tmp/kernels.cu.orig
trap 'cp /tmp/kernels.cu.orig "$kernels"' EXIT
for arm in A1 B1 B2 A2; do
  cp /tmp/kernels.cu.orig "$kernels"
  [[ $arm == B* ]] && sed -i 's/__stcg(reinterpret_cast<V\*>(out\[u\]), buf\[u\]);/__stcs(reinterpret_cast<V*>(out[u]), buf[u]);/' "$kernels"
  python3 -c "from kvstrata.native import cuda_ext; cuda_ext.load()" || exit 1
  for cell in "llama-3.1-8b 15104 1024" "llama-3.1-70b-tp8 4096 128,1024"; do
    set -- $cell
    timeout 120 python3 benchmarks/ttft.py --shape "$1" --prefix "$2" --new "$3" --placements engine \
      --formats vllm-LBNHC --widths 0,1,4 --concurrency "" --reps 3 --interference 3 --pool-gib 0 \
      --out "$out/$arm-$1.json" > "$out/$arm-$1.txt" 2>&1
    echo "$arm $1: exit $?"
  done
done
python3 - "$out" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "[AB][12]-*.json"))):
    r = json.load(open(path))
    for fmt, fr in r["formats"].items():
        for new, arms in fr["concurrency_1"].items():
            ttft = {k: v["ttft_ms"]["median"] for k, v in arms.items()}
            slowed = fr.get("compute_under", {}).get(new, {}).get("slowed_ms")
            print(os.path.basename(path), new, ttft, "compute slowed by", slowed)
PY
