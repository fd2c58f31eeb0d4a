"""Speaker conditions of Qwen2.5-Omni (``spk_dict.pt``), read without executing code.

The released checkpoint ships its voices as a ``torch.save`` file: a zip holding ``<name>/data.pkl`` (a pickle) and
one raw record per tensor storage (``<name>/data/<key>``). ``pickle.load`` on it would run whatever the pickle names,
so :func:`read_torch_zip` interprets the pickle's opcodes itself with a machine that can only build dicts, lists,
tuples, strings, numbers and tensors (numpy arrays from the zip's storage records); any other callable the pickle
names is an error. ``omnitide convert`` rewrites the voices as ``speech/speakers.safetensors``.

Each voice is ``{"cond": [1, enc_emb_dim] speaker vector, "ref_mel": [1, frames, mel_dim] reference mel,
"bos_token": the thinker token that opens the talker's text track}``.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..loading import CheckpointError

_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16, "BFloat16Storage": "bf16",
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
    "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _Mark:
    pass


class _Global:
    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


def read_torch_zip(path) -> object:
    """The object a ``torch.save`` zip holds, built from dicts / lists / tuples / str / int / float / bool / None
    and numpy arrays only. Raises CheckpointError on anything else (a callable outside the tensor rebuild)."""
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{path.name} is not a torch zip file ({e})") from None
    with zf:
        pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkls) != 1:
            raise CheckpointError(f"{path.name}: expected one data.pkl in the zip, found {len(pkls)}")
        prefix = pkls[0][: -len("data.pkl")]
        names = set(zf.namelist())
        order = zf.read(prefix + "byteorder").decode().strip() if prefix + "byteorder" in names else "little"
        if order != "little":
            raise CheckpointError(f"{path.name}: byte order {order!r} is not supported")

        def storage(key: str, dtype, numel: int) -> np.ndarray:
            name = f"{prefix}data/{key}"
            if name not in names:
                raise CheckpointError(f"{path.name}: storage record {key!r} is missing")
            raw = zf.read(name)
            if dtype == "bf16":
                bits = np.frombuffer(raw, dtype="<u2", count=numel).astype(np.uint32) << 16
                return bits.view(np.float32)
            return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"), count=numel)

        return _Unpickler(zf.read(pkls[0]), storage, path.name).run()


class _Unpickler:
    """A pickle machine for the opcodes ``torch.save`` (protocol 2) emits, with a fixed set of constructors."""

    def __init__(self, data: bytes, storage, what: str):
        self.f = io.BytesIO(data)
        self.storage, self.what = storage, what
        self.stack: list = []
        self.memo: dict = {}
        self.storages: dict = {}

    def fail(self, msg: str):
        raise CheckpointError(f"{self.what}: {msg}")

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            self.fail("truncated pickle")
        return b

    def pop_mark(self) -> list:
        for i in range(len(self.stack) - 1, -1, -1):
            if isinstance(self.stack[i], _Mark):
                items = self.stack[i + 1:]
                del self.stack[i:]
                return items
        self.fail("pickle MARK missing")

    def persistent(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)):
            self.fail(f"unsupported persistent id {pid!r}")
        _, kind, key, _location, numel = pid
        if kind.module != "torch" or kind.name not in _STORAGE_DTYPES:
            self.fail(f"unsupported storage type {kind.module}.{kind.name}")
        if key not in self.storages:
            self.storages[key] = self.storage(str(key), _STORAGE_DTYPES[kind.name], int(numel))
        return self.storages[key]

    def call(self, fn, args):
        if not isinstance(fn, _Global):
            self.fail("REDUCE on a non-global")
        name = f"{fn.module}.{fn.name}"
        if name == "collections.OrderedDict":
            return dict(*args)
        if name == "torch._utils._rebuild_tensor_v2":
            store, offset, size, stride = args[:4]
            if not isinstance(store, np.ndarray):
                self.fail("tensor without storage")
            item = store.itemsize
            if size and (offset + sum((s - 1) * st for s, st in zip(size, stride)) >= store.size):
                self.fail("tensor reaches past its storage")
            view = np.lib.stride_tricks.as_strided(store[offset:], shape=tuple(size),
                                                   strides=tuple(st * item for st in stride))
            return np.array(view)
        self.fail(f"the pickle calls {name}, which this reader does not run")

    def run(self):
        st, rd = self.stack, self.read
        while True:
            op = rd(1)
            if op == b"\x80":  # PROTO
                rd(1)
            elif op == b"\x95":  # FRAME
                rd(8)
            elif op == b"}":
                st.append({})
            elif op == b"]":
                st.append([])
            elif op == b")":
                st.append(())
            elif op == b"(":
                st.append(_Mark())
            elif op == b"X":
                st.append(rd(struct.unpack("<I", rd(4))[0]).decode("utf-8"))
            elif op == b"\x8c":
                st.append(rd(rd(1)[0]).decode("utf-8"))
            elif op == b"K":
                st.append(rd(1)[0])
            elif op == b"M":
                st.append(struct.unpack("<H", rd(2))[0])
            elif op == b"J":
                st.append(struct.unpack("<i", rd(4))[0])
            elif op == b"\x8a":  # LONG1
                n = rd(1)[0]
                st.append(int.from_bytes(rd(n), "little", signed=True))
            elif op == b"G":
                st.append(struct.unpack(">d", rd(8))[0])
            elif op == b"\x88":
                st.append(True)
            elif op == b"\x89":
                st.append(False)
            elif op == b"N":
                st.append(None)
            elif op == b"q":
                self.memo[rd(1)[0]] = st[-1]
            elif op == b"r":
                self.memo[struct.unpack("<I", rd(4))[0]] = st[-1]
            elif op == b"\x94":  # MEMOIZE
                self.memo[len(self.memo)] = st[-1]
            elif op == b"h":
                st.append(self.memo[rd(1)[0]])
            elif op == b"j":
                st.append(self.memo[struct.unpack("<I", rd(4))[0]])
            elif op == b"c":  # GLOBAL: only named here, never imported
                module = self.f.readline().decode("ascii").strip()
                name = self.f.readline().decode("ascii").strip()
                st.append(_Global(module, name))
            elif op == b"\x93":  # STACK_GLOBAL
                name, module = st.pop(), st.pop()
                st.append(_Global(module, name))
            elif op == b"Q":  # BINPERSID
                st.append(self.persistent(st.pop()))
            elif op == b"t":
                st.append(tuple(self.pop_mark()))
            elif op == b"\x85":
                st.append((st.pop(),))
            elif op == b"\x86":
                b = st.pop()
                st.append((st.pop(), b))
            elif op == b"\x87":
                c, b = st.pop(), st.pop()
                st.append((st.pop(), b, c))
            elif op == b"R":
                args = st.pop()
                st.append(self.call(st.pop(), args))
            elif op == b"s":
                v, k = st.pop(), st.pop()
                st[-1][k] = v
            elif op == b"u":
                items = self.pop_mark()
                st[-1].update(zip(items[::2], items[1::2]))
            elif op == b"a":
                v = st.pop()
                st[-1].append(v)
            elif op == b"e":
                items = self.pop_mark()
                st[-1].extend(items)
            elif op == b".":
                if len(st) != 1:
                    self.fail("malformed pickle (stack not empty at STOP)")
                return st[0]
            else:
                self.fail(f"unsupported pickle opcode {op!r}")


# --- writing (tiny checkpoints) ------------------------------------------------------------------------------------

def write_torch_zip(path, obj: dict, archive: str = "spk_dict") -> None:
    """Write ``obj`` (nested dicts of str keys with numpy float32 arrays, ints and strings) as ``torch.save``
    lays it out, so that ``torch.load`` and transformers read it (the tiny checkpoints' ``spk_dict.pt``)."""
    out = io.BytesIO()
    records: list[np.ndarray] = []

    def w(b: bytes):
        out.write(b)

    def emit(x):
        if isinstance(x, dict):
            w(b"}(")
            for k, v in x.items():
                emit(k)
                emit(v)
            w(b"u")
        elif isinstance(x, str):
            b = x.encode("utf-8")
            w(b"X" + struct.pack("<I", len(b)) + b)
        elif isinstance(x, (bool, np.bool_)):
            w(b"\x88" if x else b"\x89")
        elif isinstance(x, (int, np.integer)):
            w(b"J" + struct.pack("<i", int(x)))
        elif isinstance(x, tuple):
            w(b"(")
            for v in x:
                emit(v)
            w(b"t")
        elif isinstance(x, np.ndarray):
            a = np.ascontiguousarray(x, dtype=np.float32)
            key = str(len(records))
            records.append(a)
            w(b"ctorch._utils\n_rebuild_tensor_v2\n(")
            w(b"(")
            emit("storage")
            w(b"ctorch\nFloatStorage\n")
            emit(key)
            emit("cpu")
            emit(int(a.size))
            w(b"tQ")
            emit(0)
            emit(tuple(int(s) for s in a.shape))
            emit(tuple(int(s) // 4 for s in a.strides))
            w(b"\x89ccollections\nOrderedDict\n)Rt" + b"R")
        else:
            raise TypeError(f"cannot write {type(x).__name__}")

    w(b"\x80\x02")
    emit(obj)
    w(b".")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{archive}/data.pkl", out.getvalue())
        zf.writestr(f"{archive}/byteorder", "little")
        for i, a in enumerate(records):
            zf.writestr(f"{archive}/data/{i}", a.astype("<f4").tobytes())
        zf.writestr(f"{archive}/version", "3\n")


# --- voices ----------------------------------------------------------------------------------------------------

@dataclass
class Speaker:
    name: str
    cond: np.ndarray  # [enc_emb_dim] float32
    ref_mel: np.ndarray  # [frames, mel_dim] float32
    bos_token: int


SPEAKERS_FILE = "speakers.safetensors"


def speakers_from_dict(d: object, what: str) -> dict[str, Speaker]:
    if not isinstance(d, dict) or not d:
        raise CheckpointError(f"{what}: expected a dict of voices")
    out = {}
    for name, v in d.items():
        if not isinstance(name, str) or not isinstance(v, dict) or not {"cond", "ref_mel", "bos_token"} <= set(v):
            raise CheckpointError(f"{what}: voice {name!r} needs cond, ref_mel and bos_token")
        cond = np.asarray(v["cond"], dtype=np.float32).reshape(-1)
        ref = np.asarray(v["ref_mel"], dtype=np.float32)
        ref = ref.reshape(ref.shape[-2], ref.shape[-1]) if ref.ndim >= 2 else ref
        if ref.ndim != 2:
            raise CheckpointError(f"{what}: voice {name!r} ref_mel has shape {np.shape(v['ref_mel'])}")
        out[name] = Speaker(name, cond, ref, int(np.asarray(v["bos_token"]).reshape(-1)[0]))
    return out


def load_speakers(folder: Path) -> dict[str, Speaker]:
    """The voices of a checkpoint folder: ``speech/speakers.safetensors`` (converted) or ``spk_dict.pt``."""
    folder = Path(folder)
    st = folder / "speech" / SPEAKERS_FILE
    if st.exists():
        from safetensors.numpy import load_file

        flat = load_file(str(st))
        nested: dict = {}
        for k, v in flat.items():
            name, _, field = k.rpartition(".")
            nested.setdefault(name, {})[field] = v
        return speakers_from_dict(nested, st.name)
    pt = folder / "spk_dict.pt"
    if not pt.exists():
        raise CheckpointError(f"{folder} has no spk_dict.pt (the voices of the talker)")
    return speakers_from_dict(read_torch_zip(pt), pt.name)


def save_speakers(speakers: dict[str, Speaker], path: Path) -> None:
    from safetensors.numpy import save_file

    flat = {}
    for name, s in speakers.items():
        flat[f"{name}.cond"] = s.cond
        flat[f"{name}.ref_mel"] = s.ref_mel
        flat[f"{name}.bos_token"] = np.asarray([s.bos_token], dtype=np.int64)
    save_file(flat, str(path))
