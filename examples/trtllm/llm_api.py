"""kvstrata with TensorRT-LLM's LLM API (PyTorch backend, TensorRT-LLM 1.2.x).

Not run in kvstrata's CI: TensorRT-LLM cannot be installed there (see README.md). Start a server first::

    kvstrata serve --address ipc:///run/kvstrata/kvstrata.sock

then run this with kvstrata's settings in the environment every TensorRT-LLM rank inherits::

    KVSTRATA_TRTLLM_CONFIG='{"server_address": "ipc:///run/kvstrata/kvstrata.sock", "layers_per_slice": 1}' \\
        python llm_api.py /path/to/model
"""

import sys

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig


def main(model: str) -> None:
    llm = LLM(
        model=model,
        backend="pytorch",
        # kvstrata owns the prefix reuse it serves; keep TensorRT-LLM's host offload off (host_cache_size 0)
        kv_cache_config=KvCacheConfig(tokens_per_block=32, enable_block_reuse=True),
        kv_connector_config=KvCacheConnectorConfig(
            connector_module="kvstrata.adapters.trtllm.connector",
            connector_scheduler_class="KvstrataScheduler",
            connector_worker_class="KvstrataWorker",
        ),
    )
    prompt = "kvstrata loads cached KV one layer at a time. " * 40
    params = SamplingParams(max_tokens=32, temperature=0.0)
    first = llm.generate([prompt], params)[0].outputs[0].text   # computed, then stored
    second = llm.generate([prompt], params)[0].outputs[0].text  # its prefix loaded by kvstrata
    print(first == second, second)


if __name__ == "__main__":
    main(sys.argv[1])
