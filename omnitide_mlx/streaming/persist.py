"""Save / restore of a session: one folder, safetensors for arrays and JSON for the rest (``SESSION_FORMAT``),
written atomically. ``restore`` reads and checks the folder and hands it (a ``_Saved``) to ``__init__``, so a
restored session is set up by the same path as a new one.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..core.layout import LayoutSpec
from ..core.pick import make_policy
from ..core.stream_units import MediaSetting
from ..core.units import History
from ..errors import RestoreError, SessionBusyError, SessionError
from ..models.family import family_of
from .records import UpdateRecord, SessionCounters, _Waiting


SESSION_FORMAT = 2  # 2: records the model's family and KV shape, and the names of the saved arrays


READABLE_FORMATS = (1, 2)


SESSION_FILES = ("session.json", "kv.safetensors", "session.safetensors", "recall.safetensors")


@dataclass
class _Saved:
    """A saved session being restored: its folder and checked JSON (``restore`` hands it to ``__init__``)."""

    path: Path
    meta: dict

    @property
    def file(self) -> Path:
        return self.path / "session.json"

    def media(self) -> MediaSetting | None:
        """The media setting the session streamed at (format-2 files from before it was recorded: the default)."""
        try:
            media = self.meta.get("media")
            return None if not media else MediaSetting(
                frame_size=tuple(media["frame_size"]) if media.get("frame_size") else None,
                max_pixels=media.get("max_pixels"), max_slice_nums=media.get("max_slice_nums"),
                audio_seconds=float(media.get("audio_seconds", 1.0)), name=str(media.get("name", "default")))
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise RestoreError(f"{self.file} records a malformed media setting: {type(e).__name__}: {e}") from e


def model_family(model) -> str:
    """A model's family for saved sessions: its family record's name (``qwen2_5_omni``, ``minicpmo``, ...), the
    same for the MLX and the torch port of one model, else its class name (models/family.py: ``family_of``)."""
    return family_of(model)


def _check_model(file: Path, saved: dict | None, model, spec) -> None:
    if not saved:  # format 1 recorded neither; the KV cache's shape is still checked
        return
    family = model_family(model)
    if saved.get("family") != family:
        raise RestoreError(f"{file} was saved from a {saved.get('family')} model; this one is {family}: restore it "
                           "with the model it was saved with")
    got = {"num_layers": spec.num_layers, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim,
           "position_axes": spec.position_axes}
    diff = {k: (saved.get(k), v) for k, v in got.items() if saved.get(k) != v}
    if diff:
        raise RestoreError(f"{file} was saved from another {family} size (saved vs this model: "
                           + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items()) + ")")


REPLACE_ATTEMPTS = 50  # saves racing for one folder: each round one of them lands


def _replace_dir(new: Path, path: Path) -> None:
    """Put the folder ``new`` at ``path`` by renames: an older folder there is moved aside first and removed
    after. Other processes (or threads) may be saving to ``path`` at the same time: a rename that finds the place
    taken or the old folder gone tries again, so every save lands whole (the last one stays) and nothing is left
    beside ``path``; SessionError if the place never comes free."""
    import errno

    taken = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR)
    old = path.parent / f".{path.name}.old-{os.getpid()}-{threading.get_ident()}"
    for _ in range(REPLACE_ATTEMPTS):
        try:
            os.replace(new, path)  # the place is free (or an empty folder)
            return
        except OSError as e:
            if e.errno not in taken:
                raise
        try:
            os.replace(path, old)  # another save is there: move it aside
        except FileNotFoundError:
            continue  # a racing save moved it first
        try:
            os.replace(new, path)
        except OSError as e:
            if e.errno in taken:  # a racing save landed in between: it is whole; go round again
                shutil.rmtree(old, ignore_errors=True)
                continue
            try:
                os.replace(old, path)  # any other failure: the older save goes back in place
            except OSError:
                pass
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    raise SessionError(f"could not save to {path}: other saves to the same folder kept taking its place "
                       f"({REPLACE_ATTEMPTS} tries)")


def _model_ref(model) -> str:
    """What a saved session records as its model: an existing local path made absolute (a relative one would be
    looked up on the Hub when restored from another folder), anything else (a Hub id) as given."""
    p = Path(os.fspath(model)).expanduser()
    return str(p.resolve()) if p.exists() else os.fspath(model)


class Persistence:
    """Save / restore (``__init__`` builds a restored session from a ``_Saved``).

    A part of StreamingSession (engine.py), which holds the state these methods use."""

    def save(self, path: str | os.PathLike) -> Path:
        """Write the whole state (KV, page table, units, positions, adapter protocol state, buffered input) to a
        folder: safetensors for arrays, JSON for the rest. Atomic: everything is written to a temporary folder
        next to ``path`` that then takes its place, so a crash or a full disk never leaves a half-written session
        (an older save at ``path`` stays whole until the new one is complete)."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or set(p.name for p in path.iterdir()) - set(SESSION_FILES)):
            raise SessionError(f"{path} exists and is not a saved session: choose a new folder (save replaces "
                               "the folder as a whole)")
        with self._engine(settle=False):
            if self._open is not None and not self._open.abandoned:
                raise SessionBusyError(f"cannot save to {path} while a reply is open: read it to the end or close() "
                                       "its iterator first")
            self._settle_locked()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{path.name}.saving-{os.getpid()}-{threading.get_ident()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            try:
                self._write(tmp)
                _replace_dir(tmp, path)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        return path

    def _write(self, path: Path) -> None:
        self.cache.save(path / "kv.safetensors")
        meta_adapter, arrays = self.adapter.state()
        arrays = dict(arrays)
        if self._audio_buf.size:
            arrays["session.audio_buf"] = self._audio_buf
        for i, w in enumerate(self._waiting):
            arrays[f"session.waiting_frame.{i}"] = w.frame
        if self._last_logits is not None:
            arrays["session.last_logits"] = self._last_logits
        if arrays:
            self.backend.save_arrays(path / "session.safetensors", arrays)
        spec = self.adapter.kv_spec
        meta = {
            "format": SESSION_FORMAT,
            "backend": self.backend.name,
            "model_path": _model_ref(self.model_path) if self.model_path else None,
            "model": {"family": model_family(self.model), "num_layers": spec.num_layers, "kv_heads": spec.kv_heads,
                      "head_dim": spec.head_dim, "position_axes": spec.position_axes},
            "system_prompt": self.system_prompt,
            "media": self.media.to_json() if self.media is not None else None,
            "policy": self.policy.config(),
            "layout": self.layout.to_json(),
            "kv_budget": self.kv_budget,
            "recall": self._recall_meta(path),
            "kv_dtype": self.backend.dtype_name(self.kv_dtype),
            "history": self.history.to_json(),
            "adapter": meta_adapter,
            "arrays": sorted(arrays),
            "counters": asdict(self.counters),
            "records": [asdict(r) for r in self.records],
            "stream": {"seconds": self._seconds, "audio_driven": self._audio_driven,
                       "pending_t": self._pending_t,
                       "waiting": [{"t": w.t, "with_audio": w.with_audio} for w in self._waiting]},
        }
        with open(path / "session.json", "w", encoding="utf-8") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read_meta(cls, path: str | os.PathLike) -> dict:
        """The JSON side of a saved session, checked (format version, required keys); RestoreError otherwise."""
        path = Path(path)
        file = path / "session.json"
        if not file.is_file():
            raise RestoreError(f"{path} holds no saved session ({file.name} missing)")
        try:
            with open(file, encoding="utf-8") as f:
                meta = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RestoreError(f"{file} is not valid JSON (truncated or corrupted?): {e}") from None
        if not isinstance(meta, dict):
            raise RestoreError(f"{file} does not hold a saved session")
        if meta.get("format") not in READABLE_FORMATS:
            raise RestoreError(f"{file}: session format {meta.get('format')!r}; this version reads "
                               f"{', '.join(map(str, READABLE_FORMATS))} (saved by another omnitide-mlx version?)")
        missing = [k for k in ("kv_dtype", "policy", "history", "counters") if k not in meta]
        if missing:
            raise RestoreError(f"{file} is incomplete: missing {', '.join(missing)}")
        return meta

    @classmethod
    def restore(cls, path: str | os.PathLike, model=None, processor=None,
                on_update: Callable[[UpdateRecord], None] | None = None, **kwargs):
        """Load a session written by ``save``. ``model`` defaults to the model the session was created from (its
        absolute path, or Hub id). Every problem with the saved files raises RestoreError naming the file; a
        model of another family or shape than the saved one raises it too, before any state is built.
        ``kwargs`` go to the constructor (``backend=`` for this class; a subclass's own options)."""
        saved = _Saved(Path(path), cls.read_meta(path))
        if model is None:
            if not saved.meta.get("model_path"):
                raise RestoreError(f"{saved.file} does not record its model; pass model=")
            model = saved.meta["model_path"]
        return cls(model, processor, on_update=on_update, _saved=saved, **kwargs)

    def _load_saved(self, saved: _Saved) -> None:
        """The saved settings, history, counters and cache (``__init__`` of a restored session)."""
        meta, file = saved.meta, saved.file
        try:
            self.kv_dtype = self.backend.dtype_from_name(meta["kv_dtype"])
            cfg = dict(meta["policy"])
            self.policy = make_policy(cfg.pop("name"), **cfg)
            # sessions saved before the layout was recorded: the policy's layout as this backend builds it
            self.layout = (LayoutSpec.from_json(meta["layout"]) if meta.get("layout") is not None
                           else self.backend.layout_spec(self.policy.layout))
            self.history = History.from_json(meta["history"])
            self.counters = SessionCounters(**meta["counters"])
            self.records = [UpdateRecord(**r) for r in meta.get("records", [])]
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise RestoreError(f"{file} is malformed: {type(e).__name__}: {e}") from e
        self.system_prompt = meta.get("system_prompt")
        kv_file = saved.path / "kv.safetensors"
        if not kv_file.is_file():
            raise RestoreError(f"{kv_file} is missing: the saved session has no KV cache")
        try:
            self.cache = self.backend.load_cache(self.model, kv_file)
        except Exception as e:  # safetensors, MLX and CacheError all say it differently
            raise RestoreError(f"{kv_file} cannot be read (truncated or corrupted?): {e}") from e
        spec = self.adapter.kv_spec
        if (self.cache.num_layers, self.cache.kv_heads, self.cache.head_dim) != (spec.num_layers, spec.kv_heads,
                                                                               spec.head_dim):
            raise RestoreError(f"{kv_file} holds a KV cache of {self.cache.num_layers} layers x {self.cache.kv_heads} "
                               f"heads x {self.cache.head_dim}; the model needs {spec.num_layers} x {spec.kv_heads} x "
                               f"{spec.head_dim}: restore it with the model it was saved with")
        try:
            self.cache.page_table.check_history(self.history)
        except ValueError as e:
            raise RestoreError(f"{kv_file} and {file} disagree (files from different saves?): {e}") from e
        q = self.cache.meta_state.get("kv_quant")
        self.kv_quant = {} if not q else {"kv_bits": q["bits"], "kv_group_size": q["group_size"],
                                          "keep_sinks_full": q["keep_sinks_full"]}
        self.kv_budget = meta.get("kv_budget")
        table = self.cache.page_table
        if table.placement != self.layout.placement:
            raise RestoreError(f"{kv_file} was written with {table.placement} placement, the saved layout places "
                               f"{self.layout.placement} (files from different saves?)")
        self.planner = self.layout.planner()

    def _load_saved_stream(self, saved: _Saved) -> None:
        """The saved buffered input, last logits and adapter state (``__init__`` of a restored session)."""
        meta, file = saved.meta, saved.file
        arrays_file = saved.path / "session.safetensors"
        want = set(meta.get("arrays", []))
        try:
            arrays = self.backend.load_arrays(arrays_file) if arrays_file.exists() else {}
        except Exception as e:
            raise RestoreError(f"{arrays_file} cannot be read (truncated or corrupted?): {e}") from e
        if want - set(arrays):
            what = "is missing" if not arrays_file.exists() else f"lacks {', '.join(sorted(want - set(arrays)))}"
            raise RestoreError(f"{arrays_file} {what}: the saved session is incomplete")
        try:
            if "session.audio_buf" in arrays:
                self._audio_buf = np.asarray(arrays.pop("session.audio_buf"), dtype=np.float32)
            stream = meta.get("stream", {})
            if "session.pending_frame" in arrays:  # saved before frames queued: one frame waiting
                self._waiting.append(_Waiting(np.asarray(arrays.pop("session.pending_frame"), dtype=np.uint8),
                                              None, True))
            for i, w in enumerate(stream.get("waiting", [])):
                self._waiting.append(_Waiting(np.asarray(arrays.pop(f"session.waiting_frame.{i}"), dtype=np.uint8),
                                              None if w["t"] is None else float(w["t"]), bool(w["with_audio"])))
            self._last_logits = arrays.pop("session.last_logits", None)
            self._seconds = float(stream.get("seconds", 0.0))
            self._audio_driven = bool(stream.get("audio_driven", False))
            self._pending_t = stream.get("pending_t")
            self.adapter.load_state(meta.get("adapter", {}), arrays)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise RestoreError(f"{arrays_file} or the adapter state in {file} is malformed: "
                               f"{type(e).__name__}: {e}") from e
