#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvbridge with its dev tools into it. Idempotent.
# Usage: source scripts/setup.sh   (or run it; other scripts source it)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVBRIDGE_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.kvbridge-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -e "$root[dev]"
  touch "$stamp"
fi
