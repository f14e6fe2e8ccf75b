#!/bin/bash
# vLLM's multi-turn benchmark on ONE `kvbridge up --cpu-engines` stack, modes alternating
# (off id, id off, ...) so that both see the same machine; per run: the benchmark's stats, each
# engine's /metrics before and after (scrape.py), every stack thread's CPU ticks (threads.py).
# Needs /tmp/vllm-mt as README.md says. Usage: OUT=DIR PAIRS=8 drive.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
cd /tmp/vllm-mt
OUT=${OUT:-/tmp/vllm-mt/out-tpot}; mkdir -p "$OUT"
K=/work/main/.venv/bin/kvbridge
PY=/work/main/.venv/bin/python
PAIRS=${PAIRS:-8}
rm -f "$OUT/ready.json"
$K up --cpu-engines --work-dir /tmp/vllm-mt/work --gateway-listen 127.0.0.1:0 \
   --registry-listen 127.0.0.1:0 --router-listen 127.0.0.1:0 --ready-json "$OUT/ready.json" \
   > "$OUT/up.log" 2>&1 &
UP=$!
for _ in $(seq 300); do [ -s "$OUT/ready.json" ] && break; sleep 1; done
[ -s "$OUT/ready.json" ] || { echo "stack not ready"; kill -INT $UP; wait $UP; exit 1; }
GW=$($PY -c "import json;print(json.load(open('$OUT/ready.json'))['gateway'])")
MODEL=/tmp/vllm-mt/work/tiny-model
SERVED=$(curl -s "$GW/v1/models" | $PY -c "import json,sys;print(json.load(sys.stdin)['data'][0]['id'])")
for i in $(seq "$PAIRS"); do
  if [ $((i % 2)) = 1 ]; then order="off id"; else order="id off"; fi
  for mode in $order; do
    tag=$i-$mode
    flag="--header X-Kvbridge-Conversation-Lookup=off"
    [ "$mode" = id ] && flag="--send-conversation-id"
    $PY "$HERE/threads.py" $UP > "$OUT/thr-before-$tag.json"
    $PY "$HERE/scrape.py" "$OUT/ready.json" > "$OUT/metrics-before-$tag.json"
    # A fresh conversation id prefix per pair: no run continues another's conversations.
    CONV_PREFIX=p$i- PYTHONPATH=/tmp/vllm-mt/deps HF_HUB_OFFLINE=1 $PY bench_mt_prefixed.py \
       -u "$GW" -m $MODEL --served-model-name "$SERVED" -i small.json -p 2 -k 2 \
       --no-early-stop --seed "$i" $flag --stats-json-output "$OUT/stats-$tag.json" \
       -o "$OUT/conv-$tag.json" > "$OUT/bench-$tag.log" 2>&1
    echo "$tag: bench rc=$?"
    $PY "$HERE/threads.py" $UP > "$OUT/thr-after-$tag.json"
    $PY "$HERE/scrape.py" "$OUT/ready.json" > "$OUT/metrics-after-$tag.json"
    sleep 2
  done
done
kill -INT $UP; wait $UP
