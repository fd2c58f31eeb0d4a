# Source this before starting Python: preloads Debian's OpenBLAS so MLX's CPU backend does float32 matmul with
# it instead of the reference BLAS bundled in the mlx-cpu wheel. `import omnitide_mlx` now does the same by itself
# (omnitide_mlx/blas.py); this stays for programs that import mlx before omnitide_mlx. Does nothing where OpenBLAS is absent (macOS
# uses Accelerate and Metal anyway).
for _lib in /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/openblas-pthread/libblas.so.3; do
  if [ -e "$_lib" ]; then
    case ":${LD_PRELOAD:-}:" in *":$_lib:"*) ;; *) export LD_PRELOAD="$_lib${LD_PRELOAD:+:$LD_PRELOAD}" ;; esac
    break
  fi
done
unset _lib
