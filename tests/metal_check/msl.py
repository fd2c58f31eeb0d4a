"""Check the project's Metal kernels on a machine without Metal: capture, clang type-check, CPU emulation.

Adapted from ../shared/tools/metal-check (see its README for the method), extended with bfloat16 inputs and outputs
and driven by the kernel specs the package itself builds (``metal_attention_spec``, ``page_compact_spec``), so the
source checked here is exactly the source ``mx.fast.metal_kernel`` compiles on a Mac.

* ``generated_source(spec)``: the Metal source MLX generates for the call. Calling a metal_kernel without a Metal
  back-end raises, but inside ``mx.export_function`` tracing it succeeds and, with ``verbose=True``, prints the
  generated source to fd 1, which we capture.
* ``clang_check(src)``: ``clang++ -fsyntax-only`` against ``metal_shim.h`` (MSL address spaces, vector types,
  half / bfloat, simd functions, barriers), after three line-preserving rewrites (``to_cpp``).
* ``emulate(spec)``: compile the same source as C++ against ``metal_emu.h`` and run every GPU thread as a fiber
  (real threadgroup barriers and simd collectives), on numpy copies of the inputs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

import mlx.core as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
HEADERS = os.path.join(HERE, os.pardir, os.pardir, "metal", "checker")  # the repository's top-level metal/
SHIM = os.path.normpath(os.path.join(HEADERS, "metal_shim.h"))
EMU = os.path.normpath(os.path.join(HEADERS, "metal_emu.h"))
CACHE = os.environ.get("MSL_EMU_CACHE", os.path.join(tempfile.gettempdir(), "omnitide_msl_emu"))
CLANG_FLAGS = ["-std=c++17", "-Wno-unknown-attributes", "-Wno-user-defined-literals", "-ferror-limit=50"]
ATTRS = ("thread_position_in_grid thread_position_in_threadgroup threadgroup_position_in_grid "
         "threads_per_threadgroup threadgroups_per_grid threads_per_grid grid_size thread_index_in_threadgroup "
         "simdgroup_index_in_threadgroup thread_index_in_simdgroup threads_per_simdgroup "
         "simdgroups_per_threadgroup thread_execution_width").split()
_KERNEL_ARGS = ("name", "input_names", "output_names", "source", "header")


def find_clang() -> str | None:
    """clang++ binary: $CLANGXX, else the newest clang++-NN on PATH, else clang++."""
    if os.environ.get("CLANGXX"):
        return os.environ["CLANGXX"]
    for name in [f"clang++-{v}" for v in range(22, 13, -1)] + ["clang++"]:
        path = shutil.which(name)
        if path:
            return path
    return None


def generated_source(spec: dict) -> str:
    """The Metal source MLX generates for one kernel call described by ``spec`` (no Metal needed)."""
    kernel = mx.fast.metal_kernel(**{k: spec[k] for k in _KERNEL_ARGS})

    def call(*arrays):
        return kernel(inputs=list(arrays), template=spec["template"], grid=spec["grid"],
                      threadgroup=spec["threadgroup"], output_shapes=spec["output_shapes"],
                      output_dtypes=spec["output_dtypes"], verbose=True)

    sys.stdout.flush()
    tmp = tempfile.TemporaryFile(mode="w+b")
    saved = os.dup(1)
    os.dup2(tmp.fileno(), 1)
    try:
        with tempfile.TemporaryDirectory() as d:
            mx.export_function(os.path.join(d, "k.mlxfn"), call, *spec["inputs"])
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    tmp.seek(0)
    out = tmp.read().decode()
    tmp.close()
    m = re.search(r"```\n(.*)\n```", out, re.S)
    if not m:
        raise RuntimeError("could not capture the generated source:\n" + out)
    return m.group(1)


# `threadgroup T name[N];` (not a pointer) at the start of a line
_TG_DECL = re.compile(r"(?m)^([ \t]*)threadgroup(?=[ \t]+[\w:<>, \t]+?[ \t]+\w+[ \t]*(\[[^\n;]*\])*[ \t]*;)")
_INST = re.compile(r"template\s*\[\[host_name\(\"[^\"]*\"\)\]\]\s*\[\[kernel\]\]\s*decltype\(([^;]*?)\)\s*\1\s*;")
_METAL_INCLUDE = re.compile(r"(?m)^([ \t]*)#[ \t]*include[ \t]*<metal_\w+>")


def to_cpp(src: str) -> str:
    """Rewrite what plain clang C++ rejects, keeping line numbers: the explicit [[host_name]] instantiation (taking
    the specialisation's address still instantiates and so type-checks the body), function-scope threadgroup arrays
    (made static), and the <metal_*> includes (the shim is force-included instead)."""
    counter = iter(range(1 << 30))
    src = _INST.sub(lambda m: f"static auto* __msl_inst_{next(counter)} = &{m.group(1)};", src)
    src = _TG_DECL.sub(r"\1static threadgroup", src)
    return _METAL_INCLUDE.sub(r"\1// (metal-check) #include <metal_...>", src)


def clang_check(src: str) -> tuple[bool, str]:
    """Type-check MSL source against the shim: (ok, diagnostics naming the file <kernel>)."""
    clang = find_clang()
    if clang is None:
        raise RuntimeError("no clang++ found: install clang (scripts/setup.sh --dev) or set CLANGXX")
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as fh:
        fh.write(to_cpp(src))
        path = fh.name
    try:
        r = subprocess.run([clang, *CLANG_FLAGS, "-fsyntax-only", "-include", SHIM, path],
                           capture_output=True, text=True)
    finally:
        os.unlink(path)
    return r.returncode == 0, r.stderr.replace(path, "<kernel>")


# --- emulation ----------------------------------------------------------------------------------------------------

# numpy carrier of each MLX dtype; bfloat16 travels as its raw 16 bits (numpy has no bfloat16)
_CARRIER = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.int32: np.int32,
            mx.uint32: np.uint32, mx.int64: np.int64, mx.uint8: np.uint8, mx.bool_: np.bool_, mx.int16: np.int16,
            mx.uint16: np.uint16}


def _to_carrier(a: mx.array) -> np.ndarray:
    if a.dtype not in _CARRIER:
        raise NotImplementedError(f"emulator: dtype {a.dtype} not supported")
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a)).astype(_CARRIER[a.dtype], copy=False)


def _from_carrier(x: np.ndarray, dtype) -> mx.array:
    return mx.array(x).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(x)


def build(src: str):
    """Compile generated source into a shared library (cached by content); returns (ctypes lib, buffer count)."""
    inst = re.search(r"decltype\((\w+<[^;]*?>)\)", src)
    m = re.search(r"\[\[kernel\]\]\s+void\s+(\w+)\(\n(.*?)\)\s*\{\n", src, re.S)
    name, params = m.group(1), m.group(2)
    call_name = inst.group(1) if inst else name
    args, nbuf = [], 0
    for line in params.split(",\n"):
        pm = re.match(r"\s*(.*?)\s*(\w+)\s*\[\[(\w+)(?:\((\d+)\))?\]\]", line.strip())
        typ, _, attr, idx = pm.groups()
        if attr == "buffer":
            t = re.sub(r"\b(device|constant|threadgroup|thread)\b", "", typ).strip()
            args.append(f"*(std::remove_reference_t<{t}>*)bufs[{idx}]" if t.endswith("&") else f"({t})bufs[{idx}]")
            nbuf += 1
        else:
            if attr not in ATTRS:
                raise NotImplementedError(f"emulator: attribute {attr}")
            args.append(f"ids.{attr}")
    body = re.sub(r"\ntemplate \[\[host_name.*", "\n", src)
    body = _TG_DECL.sub(r"\1static threadgroup", body)
    body = _METAL_INCLUDE.sub(r"\1// (metal-emu) #include <metal_...>", body)
    body += f"""
extern "C" int msl_emu_run(void** bufs, const int* grid, const int* tg, char* wbuf, int wlen) {{
  std::vector<std::string> w;
  int rc = emu::launch(grid, tg, [&](const emu::Ids& ids) {{ {call_name}({", ".join(args)}); }}, &w);
  std::string all; for (auto& s : w) {{ all += s; all += "\\n"; }}
  std::strncpy(wbuf, all.c_str(), wlen - 1); wbuf[wlen - 1] = 0; return rc;
}}
"""
    clang = find_clang()
    if clang is None:
        raise RuntimeError("the emulator needs a clang++ binary (set CLANGXX or install clang)")
    os.makedirs(CACHE, exist_ok=True)
    with open(EMU) as fh:
        key = hashlib.sha1((body + fh.read() + clang).encode()).hexdigest()[:16]
    so = os.path.join(CACHE, f"k_{key}.so")
    if not os.path.exists(so):
        cpp = os.path.join(CACHE, f"k_{key}.cpp")
        with open(cpp, "w") as fh:
            fh.write(body)
        tmp_so = f"{so}.{os.getpid()}.tmp"
        r = subprocess.run([clang, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-unknown-attributes",
                            "-Wno-user-defined-literals", "-include", EMU, cpp, "-o", tmp_so],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stderr[:4000])
        os.replace(tmp_so, so)
    return ctypes.CDLL(so), nbuf


def emulate(spec: dict, src: str | None = None) -> tuple[list[mx.array], list[str]]:
    """Run one kernel call on the CPU: (outputs as MLX arrays in their declared dtypes, emulator warnings)."""
    src = src or generated_source(spec)
    lib, nbuf = build(src)
    keep, ptrs = [], []
    body = spec["source"]
    for name, a in zip(spec["input_names"], spec["inputs"]):
        x = _to_carrier(a)
        keep.append(x)
        ptrs.append(x.ctypes.data)
        if a.ndim > 0:  # MLX adds these buffers only when the body names them
            extra = []
            if name + "_shape" in body:
                extra.append(np.array(a.shape, np.int32))
            if name + "_strides" in body:
                extra.append(np.array([x.strides[i] // x.itemsize for i in range(x.ndim)], np.int64))
            if name + "_ndim" in body:
                extra.append(np.array(a.ndim, np.int32))
            for e in extra:
                keep.append(e)
                ptrs.append(e.ctypes.data)
    outs = []
    for shape, dt in zip(spec["output_shapes"], spec["output_dtypes"]):
        o = np.zeros(shape, dtype=_CARRIER[dt])
        outs.append(o)
        ptrs.append(o.ctypes.data)
    if len(ptrs) != nbuf:
        raise RuntimeError(f"emulator: {len(ptrs)} buffers for a {nbuf}-buffer signature")
    arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
    grid = (ctypes.c_int * 3)(*spec["grid"])
    tg = (ctypes.c_int * 3)(*spec["threadgroup"])
    wbuf = ctypes.create_string_buffer(4096)
    rc = lib.msl_emu_run(arr, grid, tg, wbuf, 4096)
    warns = list(dict.fromkeys(w for w in wbuf.value.decode().splitlines() if w))
    if rc:
        raise RuntimeError("emulated kernel failed: " + "; ".join(warns))
    return [_from_carrier(o, dt) for o, dt in zip(outs, spec["output_dtypes"])], warns
