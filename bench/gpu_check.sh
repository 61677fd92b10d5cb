#!/usr/bin/env bash
# On one GPU, in under 5 minutes: the compiled kernel against the reference, the
# kernel against lax.top_k, and the decode overhead (flsmem against the plain cache).
# The three steps are capped at 60 + 60 + 180 seconds. Not yet run on a GPU.
# Writes results/bench/gpu-*.json; `python -m bench.report` then adds them to
# results/BENCHMARKS.md. Run from anywhere: bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
if ! $python -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
  echo "gpu_check.sh: no GPU visible to jax (backend: $($python -c 'import jax; print(jax.default_backend())'))" >&2
  exit 1
fi
timeout 60 $python -m bench.kernel_check
timeout 60 $python -m bench.kernel --sizes 256,4096,65536 --rows 8,128 --rounds 3 --out gpu-kernel
timeout 180 $python -m bench.overhead --models smollm2 --batch 1,8 --policies rmm --evict-every 8 \
  --rounds 5 --out gpu-overhead
$python -m bench.report
