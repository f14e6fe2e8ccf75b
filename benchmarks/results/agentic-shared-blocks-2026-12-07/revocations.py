"""Memory-pressure revocations of a `kvbridge bench agentic` run's KVBRIDGE leg, from its work
directory: the decodes' revocation rounds (by cause) and victims, the registry's revoked
active leases, and how many of those belonged to a conversation that had a later turn.

    python revocations.py OUT/work
"""

from __future__ import annotations

import json
import re
import sys
from datetime import datetime
from pathlib import Path


def main(work: Path) -> None:
    rounds: dict[str, int] = {}
    victims = 0
    for log in sorted(work.glob("kvbridge-decode-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "leases_revoked_for_memory" not in line:
                continue
            cause = re.search(r"cause=(\w+)", line)
            count = re.search(r"count=(\d+)", line)
            key = cause.group(1) if cause else "?"
            rounds[key] = rounds.get(key, 0) + 1
            victims += int(count.group(1)) if count else 0
    events = [json.loads(line) for line in (work / "kvbridge-up.log").read_text().splitlines()
              if line.startswith("{")]

    def at(event: dict) -> float:
        return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()

    revoked = [e for e in events if e.get("event") == "lease_revoked"
               and e.get("reason") == "memory_pressure"]
    turns = [e for e in events if "request_id" in e and "conversation" in e]
    live = sum(1 for r in revoked
               if any(t["conversation"] == r["conversation"] and at(t) > at(r) for t in turns))
    print(json.dumps({"decode_rounds_by_cause": rounds, "decode_victims": victims,
                      "registry_active_leases_revoked": len(revoked),
                      "of_conversations_with_a_later_turn": live}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
