"""Resumable results: one JSON line per finished item, written and synced as soon as the item is done.

A run folder holds ``run.json`` (what the run is: benchmark, model, data, settings) and one ``items.jsonl`` per
setting. Rerunning with the same ``run.json`` skips the items already there; a crash or Ctrl-C loses at most the
item in progress (a half-written last line is ignored). A folder made for a different run is refused rather than
mixed with it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import OmniTideError


class RunFolderError(OmniTideError, ValueError):
    """The output folder holds results of a different run."""


def open_run(out: str | os.PathLike, config: dict, overwrite: bool = False) -> Path:
    """Create ``out`` (or reuse it when its ``run.json`` equals ``config``) and return it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "run.json"
    if path.exists() and not overwrite:
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            raise RunFolderError(f"{path} is not valid JSON; remove it or pass --overwrite") from None
        if old != json.loads(json.dumps(config)):
            diff = sorted(k for k in set(old) | set(config) if old.get(k) != json.loads(json.dumps(config.get(k))))
            raise RunFolderError(f"{out} holds results of a different run (differs in: {', '.join(diff)}); use "
                                 "another --out, or --overwrite to start again")
        return out
    if overwrite:
        for f in out.rglob("items.jsonl"):
            f.unlink()
    path.write_text(json.dumps(config, indent=1), encoding="utf-8")
    return out


class ItemLog:
    """``items.jsonl`` of one setting: ``done()`` ids, ``append(id, record)``, ``records()``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._records: dict[str, dict] = {}
        if self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            good: list[str] = []
            for n, line in enumerate(lines):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    if n == len(lines) - 1:  # the item being written when the run stopped: drop it
                        continue
                    raise RunFolderError(f"{self.path}: line {n + 1} is not JSON (the file was edited?)") from None
                self._records[row["id"]] = row["record"]
                good.append(line)
            if len(good) != len(lines):  # rewrite without the torn line, so that appends start clean
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text("".join(x + "\n" for x in good), encoding="utf-8")
                os.replace(tmp, self.path)

    def done(self) -> set[str]:
        return set(self._records)

    def records(self) -> dict[str, dict]:
        return dict(self._records)

    def append(self, item_id: str, record: dict) -> None:
        line = json.dumps({"id": item_id, "record": record}, ensure_ascii=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._records[item_id] = record
