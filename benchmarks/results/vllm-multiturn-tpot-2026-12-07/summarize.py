"""One JSON line per benchmark run of a drive's output folder (see drive.sh), and one per mode
with the gateway's turn-log medians: python summarize.py OUT_DIR DRIVE_NAME >> runs.jsonl"""
import json
import statistics as st
import sys
from collections import defaultdict
from pathlib import Path

out, drive = Path(sys.argv[1]), sys.argv[2]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def engine_means(before: dict, after: dict) -> dict:
    """Per engine: mean of vLLM's request timings over the run (ms), decode's ITL."""
    res = {}
    for engine in after:
        def delta(key: str, engine: str = engine) -> float:
            return after[engine].get(key, 0.0) - before[engine].get(key, 0.0)
        for h in ("time_to_first_token", "request_queue_time", "request_prefill_time",
                  "request_inference_time", "inter_token_latency"):
            count = delta(f"vllm:{h}_seconds_count")
            if count:
                res[f"{engine}.{h}_ms"] = round(delta(f"vllm:{h}_seconds_sum") / count * 1000, 2)
    return res


def cpu_ticks(before: dict, after: dict) -> dict:
    """CPU ticks (1/100 s) over the run: per core, engines' threads by process kind, pollers
    (nice 19) apart; 'ctrl' is the control-plane process (on both cores)."""
    res: dict[str, int] = defaultdict(int)
    for key, (proc, _thread, ticks, *more) in after.items():
        cpus, nice = (more[0], more[1]) if more else (["?"], 0)  # the first drive kept neither
        spent = ticks - (before[key][2] if key in before else 0)
        kind = ("poller" if nice == 19 else "ctrl" if proc.startswith("kvbridge")
                else proc.split("|")[0].strip())
        res["core" + ",".join(map(str, cpus)) + " " + kind] += spent
    return dict(res)


for stats in sorted(out.glob("stats-*.json")):
    tag = stats.name[len("stats-"):-len(".json")]
    pair, mode = tag.split("-", 1)
    rows = load(stats)
    rec = {"drive": drive, "pair": int(pair), "mode": mode, "requests": len(rows),
           "ttft_p50_ms": round(st.median(r["ttft_ms"] for r in rows), 2),
           "tpot_p50_ms": round(st.median(r["tpot_ms"] for r in rows), 3)}
    mb, ma = out / f"metrics-before-{tag}.json", out / f"metrics-after-{tag}.json"
    if mb.exists() and ma.exists():
        rec.update(engine_means(load(mb), load(ma)))
    tb, ta = out / f"thr-before-{tag}.json", out / f"thr-after-{tag}.json"
    if tb.exists() and ta.exists():
        rec["cpu_ticks"] = cpu_ticks(load(tb), load(ta))
    print(json.dumps(rec))

turns: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
for line in (out / "up.log").read_text().splitlines():
    if '"event": "turn"' not in line:
        continue
    turn = json.loads(line)
    mode = "id" if turn.get("conversation") else "off"
    for key in ("route_ms", "lease_wait_ms", "prefill_ms", "decode_headers_ms", "ttft_ms"):
        if turn.get(key) is not None:
            turns[mode][key].append(turn[key])
for mode, values in turns.items():
    print(json.dumps({"drive": drive, "mode": mode, "gateway_turns": len(values["ttft_ms"]),
                      **{f"gateway_{k}_p50": round(st.median(v), 2) for k, v in values.items()}}))
