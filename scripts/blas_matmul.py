"""1024x1024x1024 float32 matmul on MLX's CPU, median of 7 after a warm-up; prints one JSON line with the BLAS
omnitide_mlx loaded (docs/benchmarks.md, "BLAS on Linux"):

    env -u LD_PRELOAD OMNITIDE_BLAS=reference .venv/bin/python scripts/blas_matmul.py before
    env -u LD_PRELOAD .venv/bin/python scripts/blas_matmul.py after
"""
import json, sys, time
import omnitide_mlx
import mlx.core as mx
from omnitide_mlx.blas import blas_info
mx.set_default_device(mx.cpu)
a = mx.random.normal((1024, 1024)); b = mx.random.normal((1024, 1024))
mx.eval(a @ b)
ts = []
for _ in range(7):
    t = time.perf_counter(); mx.eval(a @ b); ts.append(time.perf_counter() - t)
ts.sort()
print(json.dumps({"label": sys.argv[1], "median_ms": round(ts[3] * 1000, 2), "gflops": round(2 * 1024**3 / ts[3] / 1e9, 2),
                  "blas": blas_info()["in_use"]}))
