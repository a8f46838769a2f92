#!/usr/bin/env bash
# First-token time across model shapes, prefix lengths and engine loops (issue: gains that hold on every model).
#   bash benchmarks/ttft_sweep.sh OUT_DIR [SHAPES] [PREFIXES] [LOOPS]
# defaults: every shape of ttft.py's SHAPES, prefixes 6144 and 30720 tokens, loops sleep and spin. Each cell is one
# ttft.py run (engine placement, every engine format); FORMATS, PLACEMENTS, WIDTHS, SERIAL_WIDTHS, CHUNK_MAJOR_TOGETHER (set: the
# engine/chunk-together arm), NEW, CONCURRENCY, REPS and POOL_GIB
# override its arguments (CONCURRENCY="" runs one request only). Every JSON lands in OUT_DIR as ttft-<shape>-<prefix>-<loop>.json.
set -u
out="${1:?out dir}"
shapes="${2:-llama-3.1-8b,llama-3.1-70b-tp8,qwen2.5-7b,deepseek-v2-lite}"
prefixes="${3:-6144,30720}"
loops="${4:-sleep,spin}"
mkdir -p "$out"
rc=0
for shape in ${shapes//,/ }; do
  for prefix in ${prefixes//,/ }; do
    for loop in ${loops//,/ }; do
      name="ttft-$shape-$prefix-$loop"
      t=$(date +%s)
      timeout "${CELL_TIMEOUT_S:-300}" python3 benchmarks/ttft.py --shape "$shape" --prefix "$prefix" \
        --engine-loop "$loop" --placements "${PLACEMENTS:-engine}" --formats "${FORMATS:-vllm-LBNHC,sglang,trtllm}" \
        --widths "${WIDTHS:-0,1,2,4,8,auto}" --new "${NEW:-128,1024,4096}" --concurrency "${CONCURRENCY-2,4,8,16}" \
        --serial-widths "${SERIAL_WIDTHS:-}" ${CHUNK_MAJOR_TOGETHER:+--chunk-major-together} \
        --concurrency-new 256 --reps "${REPS:-3}" --concurrency-reps "${CONCURRENCY_REPS:-2}" \
        --pool-gib "${POOL_GIB:-16}" --out "$out/$name.json" > "$out/$name.txt" 2>&1 || rc=1
      echo "$name: $(( $(date +%s) - t )) s, exit ${PIPESTATUS[0]}"
    done
  done
done
exit $rc
