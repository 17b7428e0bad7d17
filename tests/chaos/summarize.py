"""Print the chaos report (the JSON lines chaos tests append) as one table per fault class.

``make chaos`` runs the long chaos suite with ``CORRAL_CHAOS_REPORT`` set and then this script,
so the figures in docs/reliability.md come from one command. Exit status 1 when any fault
class lost something: a soak of "0 lost" is the claim, so a loss must not scroll by unnoticed.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

DETAIL_SKIP = {"fault", "rounds", "lost", "mode", "seed", "at"}


def load(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def summarize(rows: list[dict[str, Any]]) -> tuple[Table, int]:
    by_fault: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_fault[row["fault"]].append(row)
    table = Table(title="corral chaos report")
    for column in ("fault class", "mode", "seed", "rounds", "lost", "details"):
        table.add_column(column)
    total_lost = 0
    for fault in sorted(by_fault):
        entries = by_fault[fault]
        rounds = sum(int(e["rounds"]) for e in entries)
        lost = sum(int(e["lost"]) for e in entries)
        total_lost += lost
        details: list[str] = []
        for e in entries:
            extra = {k: v for k, v in e.items() if k not in DETAIL_SKIP}
            if extra:
                details.append(", ".join(f"{k}={v}" for k, v in sorted(extra.items())))
        table.add_row(
            fault,
            ",".join(sorted({str(e["mode"]) for e in entries})),
            ",".join(sorted({str(e["seed"]) for e in entries})),
            str(rounds),
            str(lost),
            "; ".join(details),
        )
    return table, total_lost


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else "chaos-report.jsonl")
    rows = load(path)
    if not rows:
        print(f"no chaos results in {path}", file=sys.stderr)
        return 1
    table, lost = summarize(rows)
    Console(width=200).print(table)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
