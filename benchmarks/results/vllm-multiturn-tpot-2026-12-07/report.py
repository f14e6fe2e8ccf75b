"""The figures of README.md, from runs.jsonl: python report.py"""
import json
import statistics as st
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
CODE = {"A": "06ba0d0", "B": "06ba0d0", "C": "06ba0d0", "D": "lease wait in Route",
        "E": "+ no renew after a pinned read", "F": "+ gateway releases unused pins",
        "G": "cfa9825"}
runs = [json.loads(line) for line in (HERE / "runs.jsonl").read_text().splitlines()]
by_pair: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
gateway = {}
for r in runs:
    if "pair" in r:
        by_pair[(r["drive"], r["pair"])][r["mode"]] = r
    else:
        gateway[(r["drive"], r["mode"])] = r


def pairs(drives: str) -> list[tuple[dict, dict]]:
    return [(m["off"], m["id"]) for (d, _), m in sorted(by_pair.items()) if d in drives]


def line(name: str, ps: list[tuple[dict, dict]]) -> str:
    tpot = st.median(i["tpot_p50_ms"] / o["tpot_p50_ms"] for o, i in ps)
    itl = st.median(i["decode-0.inter_token_latency_ms"] / o["decode-0.inter_token_latency_ms"]
                    for o, i in ps if "decode-0.inter_token_latency_ms" in o)
    ttft = st.median(i["ttft_p50_ms"] - o["ttft_p50_ms"] for o, i in ps)
    slower = sum(i["tpot_p50_ms"] > o["tpot_p50_ms"] for o, i in ps)
    return (f"| {name} | {len(ps)} | {tpot:.3f} | {slower} of {len(ps)} | {itl:.3f} | "
            f"{ttft:+.1f} |")


print("| drives | pairs | TPOT p50 id/off (median of pairs) | pairs where id's TPOT is higher"
      " | decode ITL id/off | TTFT p50 id-off ms |")
print("|---|---|---|---|---|---|")
for d in sorted({d for d, _ in by_pair}):
    print(line(f"{d} ({CODE[d]})", pairs(d)))
print(line("A-C pooled (06ba0d0)", pairs("ABC")))
print(line("F-G pooled (cfa9825)", pairs("FG")))
print()
print("| drive | mode | gateway route ms | lease wait ms | prefill ms | decode headers ms "
      "| TTFT ms |")
print("|---|---|---|---|---|---|---|")
for (d, mode), g in sorted(gateway.items()):
    print(f"| {d} | {mode} | {g['gateway_route_ms_p50']} | {g['gateway_lease_wait_ms_p50']} | "
          f"{g['gateway_prefill_ms_p50']} | {g['gateway_decode_headers_ms_p50']} | "
          f"{g['gateway_ttft_ms_p50']} |")
print()
print("CPU ticks (1/100 s) per run, median over the drive's runs of each mode:")
for d in sorted({d for d, _ in by_pair}):
    ticks: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for (dd, _), m in by_pair.items():
        if dd != d:
            continue
        for mode, r in m.items():
            for k, v in r.get("cpu_ticks", {}).items():
                ticks[k][mode].append(v)
    if not ticks:
        continue
    print(f"| drive {d} | off | id | id - off |\n|---|---|---|---|")
    for k in sorted(ticks):
        o, i = st.median(ticks[k]["off"] or [0]), st.median(ticks[k]["id"] or [0])
        if o + i >= 10:
            print(f"| {k} | {o:.0f} | {i:.0f} | {i - o:+.0f} |")
    print()
for d in sorted({d for d, _ in by_pair}):
    engine = defaultdict(lambda: defaultdict(list))
    for (dd, _), m in by_pair.items():
        if dd == d:
            for mode, r in m.items():
                for k, v in r.items():
                    if k.startswith(("prefill-0.", "decode-0.")):
                        engine[k][mode].append(v)
    if engine:
        print(f"drive {d}, vLLM's own request timings (mean per run, median over runs):")
        for k in sorted(engine):
            off, idm = st.median(engine[k]["off"]), st.median(engine[k]["id"])
            print(f"  {k}: off {off:.2f}, id {idm:.2f}")
