#!/usr/bin/env bash
# The GPU check: kernels, parity, throughput, offload (< 9 minutes on
# one H200). Needs python with torch, transformers and triton; no Rust, no network, no hub.
#
#   bash benches/gpu_check.sh                 # report: $OUT/gpu_check.json, else ./gpu_check.json
#   bash benches/gpu_check.sh --only kernels  # extra arguments go to benches/gpu_check.py
#   bash benches/gpu_check.sh --help          # this text, then gpu_check.py's options
#
# The Python sources under python/ are the code under test. The compiled core comes from
# python/ferrobatch/_core.abi3.so when present, else from a prebuilt abi3 wheel in dist/
# (its _core is extracted next to the sources; the wheel's own .py files are not used).
#
# The core is git-ignored (*.so, /dist): a copy of the tree taken from git alone lacks it.
# Build it (`make build` or `maturin develop --release` for python/ferrobatch/_core.abi3.so,
# about 1 MB; `maturin build --release -o dist` for a wheel) and copy it along.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  echo
  exec "${PYTHON:-python3}" benches/gpu_check.py --help
fi
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

if ! ls python/ferrobatch/_core*.so >/dev/null 2>&1; then
  whl=$(ls dist/ferrobatch-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$whl" ]; then
    cat >&2 <<'MSG'
gpu_check: no compiled core (python/ferrobatch/_core*.so or dist/ferrobatch-*.whl).
  Both are git-ignored (*.so, /dist), so a copy of the tree taken from git lacks them:
  build python/ferrobatch/_core.abi3.so (`make build` or `maturin develop --release`) or a
  wheel in dist/ (`maturin build --release -o dist`) and copy it next to the sources.
MSG
    exit 2
  fi
  "$PY" - "$whl" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith("ferrobatch/_core") and name.endswith((".so", ".pyd")):
            target = "python/" + name
            with open(target, "wb") as f:
                f.write(z.read(name))
            print("gpu_check: core from", sys.argv[1], "->", target)
PYEOF
fi

"$PY" -c "import ferrobatch._core, torch, transformers; print('gpu_check: torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
OUT_DIR=${OUT:-.}
status=0
timeout 415 "$PY" benches/gpu_check.py --total-budget 390 --out "$OUT_DIR/gpu_check.json" "$@" \
  || status=$?

# The CUDA-only tests (skipped in CI: it has no GPU), when pytest is there: graph capture vs
# eager, streams and events of the async pipeline and of offload never syncing the host.
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 55 "$PY" -m pytest -q -p no:cacheprovider -x \
    tests/runner/test_graph_runner.py tests/cuda/test_cuda_graph_keys.py tests/cuda/test_staging.py \
    tests/cuda/test_async_cuda.py tests/engine/test_async_offload.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" \
    || status=$?
  # The Triton kernels compiled (on CPU CI they run interpreted); last, with its own limit:
  # many small variants to compile.
  timeout 45 "$PY" -m pytest -q -p no:cacheprovider tests/cuda/test_triton_attention.py 2>&1 \
    | tee -a "$OUT_DIR/gpu_tests.log" || status=$?
else
  echo "gpu_check: pytest not installed; the CUDA-only tests did not run" | tee "$OUT_DIR/gpu_tests.log"
fi
exit "$status"
