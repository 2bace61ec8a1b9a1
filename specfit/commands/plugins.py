"""``specfit plugins [--json]``: what is registered, by which package."""

from __future__ import annotations

import json

from specfit.registry import get_plugins


def run(as_json: bool = False) -> None:
    entries = [e.as_dict() for e in get_plugins().entries()]
    if as_json:
        print(json.dumps(entries, indent=2))
        return
    header = ("kind", "name", "distribution", "version", "class")
    rows = [(e["kind"], e["name"], e["distribution"], e["version"], e["class"]) for e in entries]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
