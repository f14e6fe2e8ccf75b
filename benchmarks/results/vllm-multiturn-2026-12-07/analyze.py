"""The figures of README.md, from the files here: python analyze.py"""
import json
import statistics as st
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent
for path in sorted(HERE.glob("*.stats.json")):
    run, mode = path.name.split(".")[:2]
    rows = json.loads(path.read_text())
    metrics = json.loads((HERE / f"{run}.{mode}.engine-metrics.json").read_text())

    def delta(engine: str, key: str, metrics: dict = metrics) -> float:
        return (metrics["after"][engine].get(key, 0.0)
                - metrics["before"][engine].get(key, 0.0))

    tokens = {k.removeprefix("tokens_"): int(delta("prefill-0", k))
              for k in metrics["after"]["prefill-0"] if k.startswith("tokens_")}
    itl = (delta("decode-0", "vllm:inter_token_latency_seconds_sum")
           / delta("decode-0", "vllm:inter_token_latency_seconds_count") * 1000)
    turns = [json.loads(line) for line in
             (HERE / f"{run}.{mode}.gateway-turns.jsonl").read_text().splitlines()]

    def med(key: str, turns: list = turns) -> float | None:
        values = [t[key] for t in turns if t.get(key) is not None]
        return round(st.median(values), 1) if values else None

    ttft = st.median(r["ttft_ms"] for r in rows)
    tpot = st.median(r["tpot_ms"] for r in rows)
    gateway = ", ".join(f"{k} {med(k + '_ms')}" for k in
                        ("route", "lease_wait", "prefill", "decode_headers", "ttft"))
    decisions = dict(Counter(t["decision"] for t in turns))
    found = dict(Counter(t.get("conversation_source") for t in turns))
    print(f"{run} {mode}: {len(rows)} requests; TTFT p50 {ttft:.1f} ms; TPOT p50 {tpot:.2f} "
          f"ms; decode ITL mean {itl:.2f} ms; prefill tokens {tokens}; gateway medians: "
          f"{gateway}; decisions {decisions}; found by {found}")
