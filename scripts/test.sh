#!/usr/bin/env bash
# The test command: sets up .venv on a fresh machine, then runs the whole test suite.
# Extra arguments go to pytest, e.g.  scripts/test.sh -m "not e2e" -x
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$root/scripts/setup.sh"
cd "$root"
exec python -m pytest "$@"
