"""results.jsonl: one row per measured cell, rewritten atomically after each cell so a crash loses at most the cell in flight.
Beside it, the other outputs a run writes whole: a text file (write_atomic), a saved model (save_whole)."""
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import zoo


class ResultStore:
    def __init__(self, path: Path, key_fields: tuple[str, ...], defaults: dict | None = None):
        """defaults: values of key fields added after rows were written (such a row had that value), so older files
        load and resume instead of being run again."""
        self.path = Path(path)
        self.key_fields = key_fields
        self.defaults = defaults or {}
        self.rows = self.load()

    def load(self) -> list[dict]:
        """The file's rows; a damaged line (torn by a killed writer, edited by hand) is skipped with a warning that
        names it, so its cell counts as not done and is run again."""
        if not self.path.exists():
            return []
        rows = []
        # read as bytes, so a byte that is not UTF-8 spoils its own line, not the whole file
        for number, line in enumerate(self.path.read_bytes().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(self.parse(line))
            except ValueError as damage:
                warnings.warn(f"{self.path}:{number}: skipped a damaged row ({damage}); its cell will be run again")
        return rows

    def parse(self, line: bytes) -> dict:
        """One row: a JSON object holding every key field, each a plain value (a list cannot name a cell)."""
        try:
            row = json.loads(line.decode("utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON: {error.msg}") from None
        except UnicodeDecodeError:
            raise ValueError("not UTF-8 text") from None
        if not isinstance(row, dict):
            raise ValueError(f"a JSON {type(row).__name__}, not an object")
        row = {**{f: v for f, v in self.defaults.items() if f not in row}, **row}
        missing = [f for f in self.key_fields if f not in row]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        unhashable = [f for f in self.key_fields if isinstance(row[f], (list, dict))]
        if unhashable:
            raise ValueError(f"{', '.join(unhashable)} not a plain value")
        return row

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


def check_output_folder(path: Path) -> None:
    """The output folder is a folder, or can be made, and can be written: checked before any work, so a bad --out
    fails at once instead of after the first measurement. Nothing is left behind: the write that proves it is a
    probe file, made and removed."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"output folder {str(path)!r} exists and is not a folder")
    nearest = next(p for p in (path, *path.parents) if p.exists())  # the folder that would hold the new ones
    if not nearest.is_dir():
        raise ValueError(f"cannot create output folder {str(path)!r}: {str(nearest)!r} is a file, not a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write output folder {str(path)!r}: {str(nearest)!r} is not writable")
    probe_write(path, nearest)


def probe_write(path: Path, nearest: Path) -> None:
    """Make and remove a uniquely named empty file in nearest: os.access trusts permission bits, which root passes
    even where no file can be made (/proc, a read-only mount)."""
    try:
        handle, probe = tempfile.mkstemp(prefix=".zoo-write-probe-", dir=nearest)  # O_EXCL: never another's file
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(f"cannot write output folder {str(path)!r}: making a file in {str(nearest)!r} failed "
                         f"({error.strerror or error})") from None


def write_atomic(path: Path, text: str) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_whole(model, folder: Path) -> Path:
    """zoo.save into FOLDER.partial, then renamed to FOLDER (replacing one there): a killed run leaves a whole
    model or none, never half of one."""
    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    zoo.save(model, partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def settings_dict(settings) -> dict:
    """A run's settings dataclass as JSON-ready values (paths as strings), for the record and the console."""
    return {name: str(value) if isinstance(value, Path) else value for name, value in dataclasses.asdict(settings).items()}
