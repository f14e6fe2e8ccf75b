"""CPU ticks of every thread of a process tree, as JSON on stdout:
{"pid:tid": [process name | command line, thread name, ticks, allowed cpus, nice, ppid]}"""
import contextlib
import json
import os
import sys


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


todo, seen = [int(sys.argv[1])], []
while todo:
    pid = todo.pop()
    seen.append(pid)
    with contextlib.suppress(OSError):
        todo += children(pid)
res = {}
for pid in seen:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ")
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            try:
                cpus = sorted(os.sched_getaffinity(int(tid)))
            except OSError:
                cpus = []
            res[f"{pid}:{tid}"] = [comm + " | " + cmd[:100], name,
                                   int(fields[11]) + int(fields[12]), cpus, int(fields[16]),
                                   int(fields[1])]
    except OSError:
        pass
print(json.dumps(res))
