#!/usr/bin/env bash
# The main job: sets up .venv on a fresh machine, then runs a multi-turn conversation through
# the lease protocol against a real registry (kvbridge registry demo).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$root/scripts/setup.sh"
exec kvbridge registry demo "$@"
