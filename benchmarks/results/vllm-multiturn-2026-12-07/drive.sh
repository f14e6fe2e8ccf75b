#!/bin/bash
# Drive vLLM's multi-turn benchmark against `kvbridge up --cpu-engines`, one fresh stack per mode.
set -u
cd /tmp/vllm-mt
OUT=${OUT:-/tmp/vllm-mt/out}; mkdir -p $OUT
K=/work/main/.venv/bin/kvbridge
PY=/work/main/.venv/bin/python
for mode in "$@"; do
  rm -f $OUT/ready-$mode.json
  $K up --cpu-engines ${UP_EXTRA:-} --work-dir /tmp/vllm-mt/work --gateway-listen 127.0.0.1:0 \
     --registry-listen 127.0.0.1:0 --router-listen 127.0.0.1:0 --ready-json $OUT/ready-$mode.json \
     > $OUT/up-$mode.log 2>&1 &
  UP=$!
  for i in $(seq 300); do [ -s $OUT/ready-$mode.json ] && break; sleep 1; done
  [ -s $OUT/ready-$mode.json ] || { echo "$mode: stack not ready"; kill -INT $UP; wait $UP; continue; }
  GW=$($PY -c "import json;print(json.load(open('$OUT/ready-$mode.json'))['gateway'])")
  MODEL=/tmp/vllm-mt/work/tiny-model
  $PY scrape.py $OUT/ready-$mode.json > $OUT/metrics-before-$mode.json
  SERVED=$(curl -s $GW/v1/models | $PY -c "import json,sys;print(json.load(sys.stdin)['data'][0]['id'])")
  flag=""; [ "$mode" = id ] && flag="--send-conversation-id"
  [ "$mode" = off ] && flag="--header X-Kvbridge-Conversation-Lookup=off"
  PYTHONPATH=/tmp/vllm-mt/deps HF_HUB_OFFLINE=1 $PY benchmark_serving_multi_turn.py -u $GW \
     -m $MODEL --served-model-name $SERVED -i small.json -p 2 -k 2 --no-early-stop --seed 0 $flag \
     --stats-json-output $OUT/stats-$mode.json -o $OUT/conv-$mode.json > $OUT/bench-$mode.log 2>&1
  echo "$mode: bench rc=$?"
  $PY scrape.py $OUT/ready-$mode.json > $OUT/metrics-after-$mode.json
  sleep 2
  kill -INT $UP; wait $UP
done
