"""Per engine of a `kvbridge up` stack (its --ready-json file): prompt tokens by source, decode
and request timing counters, as JSON on stdout."""
import json
import sys
import urllib.request
from pathlib import Path

COUNTERS = ("vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
            "vllm:request_time_per_output_token_seconds_sum",
            "vllm:request_time_per_output_token_seconds_count",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total") + tuple(
    f"vllm:{h}_seconds_{s}" for h in ("time_to_first_token", "request_queue_time",
                                      "request_prefill_time", "request_decode_time",
                                      "e2e_request_latency", "request_inference_time")
    for s in ("sum", "count"))

ready = json.loads(Path(sys.argv[1]).read_text())
out = {}
for role, url in ready["engines"].items():
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    m: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name == "vllm:prompt_tokens_by_source_total":
            source = labels.split('source="')[1].split('"')[0]
            m["tokens_" + source] = m.get("tokens_" + source, 0) + float(value)
        elif name in COUNTERS:
            m[name] = m.get(name, 0) + float(value)
    out[role] = m
print(json.dumps(out))
