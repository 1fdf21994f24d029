"""results.jsonl: one row per measured cell, rewritten atomically after each cell so a crash loses at most the cell in flight."""
import json
import os
from pathlib import Path


class ResultStore:
    def __init__(self, path: Path, key_fields: tuple[str, ...]):
        self.path = Path(path)
        self.key_fields = key_fields
        self.rows = self.load()

    def load(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn line from a killed writer of an older format; the cell is simply re-run
        return rows

    def key(self, row: dict) -> tuple:
        return tuple(row.get(f) for f in self.key_fields)

    def done(self, cell: dict) -> bool:
        key = self.key(cell)
        return any(self.key(row) == key for row in self.rows)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        os.replace(tmp, self.path)


def write_atomic(path: Path, text: str) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
