#!/usr/bin/env bash
# The main job: sets up .venv on a fresh machine, then starts the embedded stack on this CPU
# (registry, router, gateway, and a prefill and a decode vLLM engine with the connector, on
# the tiny test model), runs a 5-turn conversation through the gateway, prints per turn TTFT,
# reused and recomputed tokens and the lease, and stops everything.
# Extra arguments go to `kvbridge up` (e.g. --json).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
. "$root/scripts/setup.sh"
cd "$root"
# Prefill's own prefix cache is off here: one conversation on one prefill would find its whole
# history there, and this job shows the read back from decode that a busy fleet's prefills need
# (their caches no longer hold the conversation). `kvbridge up --cpu-engines` keeps vLLM's
# default (on), and the demo's "local" column then shows what came from that cache.
exec kvbridge up --cpu-engines --no-prefill-prefix-caching --decision threshold --demo 5 \
  --registry-listen 127.0.0.1:0 --router-listen 127.0.0.1:0 --gateway-listen 127.0.0.1:0 "$@"
