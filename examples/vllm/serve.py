"""vLLM + kvstrata on CPU, end to end: a prompt computed and stored, then loaded layer by layer.

    pip install 'kvstrata[vllm]' transformers
    kvstrata serve --address ipc:///tmp/kvstrata-example/server.sock --chunk-size 64 &
    python examples/vllm/serve.py ipc:///tmp/kvstrata-example/server.sock

Writes a small random-weight Llama to a temporary directory (no hub access), runs
the same prompt twice through one engine and prints the connector's record.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile


def main(address: str) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "vllm_engine"))
    from vllm_runner import make_model  # the tests' model writer: 8 layers, float32, random weights

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    work = tempfile.mkdtemp(prefix="kvstrata-vllm-example-")
    make_model(os.path.join(work, "model"))
    record = os.path.join(work, "record.jsonl")
    llm = LLM(model=os.path.join(work, "model"), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              block_size=32, enable_prefix_caching=False, max_model_len=4096,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KvstrataConnector", kv_connector_module_path="kvstrata.adapters.vllm",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"server_address": address, "layers_per_slice": 1,
                                             "record_path": record}))
    prompt = {"prompt_token_ids": [random.Random(0).randrange(3, 999) for _ in range(1500)]}
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    second = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    print("computed:", list(first))
    print("loaded:  ", list(second), "(same)" if list(first) == list(second) else "(DIFFERENT)")
    with open(record) as f:
        for line in f:
            e = json.loads(line)
            if e["event"] != "wait_for_layer_load":
                print(" ", {k: v for k, v in e.items() if k not in ("t", "pid")})
    return 0 if list(first) == list(second) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "ipc:///tmp/kvstrata-example/server.sock"))
