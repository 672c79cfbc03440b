#!/usr/bin/env bash
# Build llama.cpp (CPU) as a benchmark peer, from the source vendored in llama-cpp-python's sdist.
#
# Idempotent: a second run checks each step and does nothing that is already done.
#   bash benches/peers/setup_llamacpp.sh
#   LLAMACPP_HOME=/work/peers/llama.cpp bash benches/peers/setup_llamacpp.sh
#
# Where things go (all outside the repository):
#   $LLAMACPP_HOME            default ${FERROBATCH_CACHE:-~/.cache/ferrobatch}/peers/llama.cpp-<ver>
#   $LLAMACPP_HOME/venv       cmake, ninja and numpy (PyPI), not the project's .venv
#   $LLAMACPP_HOME/src        llama-cpp-python's vendor/llama.cpp
#   $LLAMACPP_HOME/build/bin  llama-server llama-batched-bench llama-bench llama-perplexity
#                             llama-quantize llama-tokenize; benches/peers/llamacpp_compare.py reads
#                             $LLAMACPP_BIN, or this directory (same default).
#
# Why the sdist: PyPI is reachable here and GitHub is not; llama-cpp-python 0.3.36 carries a
# complete llama.cpp tree. Build: GGML_NATIVE=ON (-march=native), no curl, Release.
# AMX: on some virtual machines the CPU reports AMX but the kernel has not enabled its
# state, and ggml-cpu's AMX Q4 path dies with SIGILL; when /proc/cpuinfo lists no amx_tile
# (the kernel's view) the build adds -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
# (LLAMACPP_NO_AMX=1 forces that, =0 never). On a KVM Xeon that lists amx_tile and amx_int8
# (CPUID model 167, 2026-12), the AMX build's llama-bench and llama-server died with SIGSEGV
# in libggml-cpu on the Q4_K_M file as soon as they ran a batch (they ran with --repack 0,
# which turns off every repacked layout); LLAMACPP_NO_AMX=1 built a working peer there.
set -euo pipefail

VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
CACHE="${FERROBATCH_CACHE:-$HOME/.cache/ferrobatch}"
LLAMACPP_HOME="${LLAMACPP_HOME:-$CACHE/peers/llama.cpp-$VERSION}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
TARGETS=(llama-server llama-batched-bench llama-bench llama-perplexity llama-quantize llama-tokenize)
VENV="$LLAMACPP_HOME/venv"
SRC="$LLAMACPP_HOME/src"
BUILD="$LLAMACPP_HOME/build"

log() { printf 'setup_llamacpp: %s\n' "$*"; }
mkdir -p "$LLAMACPP_HOME"

# 1. a small venv for the build tools
if [ ! -x "$VENV/bin/ninja" ] || [ ! -x "$VENV/bin/cmake" ]; then
    [ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
    log "installing cmake, ninja, numpy into $VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q cmake ninja numpy
fi

# 2. the source: llama-cpp-python's sdist, vendor/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    DL="$LLAMACPP_HOME/sdist"
    mkdir -p "$DL"
    SDIST="$(ls "$DL"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null | head -n1 || true)"
    if [ -z "$SDIST" ]; then
        log "downloading the llama-cpp-python==$VERSION sdist"
        # --no-binary for this package only: with :all: pip would build cmake from source to
        # prepare the sdist's metadata
        PATH="$VENV/bin:$PATH" "$VENV/bin/pip" download -q --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$VERSION" -d "$DL"
        SDIST="$(ls "$DL"/llama_cpp_python-"$VERSION".tar.gz | head -n1)"
    fi
    log "unpacking vendor/llama.cpp from $SDIST"
    TMP="$LLAMACPP_HOME/unpack"
    rm -rf "$TMP" && mkdir -p "$TMP"
    tar -xzf "$SDIST" -C "$TMP"
    rm -rf "$SRC"
    mv "$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
    rm -f "$SRC/.git"  # a submodule pointer into the sdist's absent .git
    rm -rf "$TMP"
fi

# 3. configure and build
NO_AMX="${LLAMACPP_NO_AMX:-}"
if [ -z "$NO_AMX" ]; then
    if grep -qw amx_tile /proc/cpuinfo; then NO_AMX=0; else NO_AMX=1; fi
fi
EXTRA_FLAGS=""
[ "$NO_AMX" = "1" ] && EXTRA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
FLAGS_STAMP="$BUILD/.ferrobatch-flags"
WANT="native=ON curl=OFF extra=[$EXTRA_FLAGS]"
if [ ! -f "$BUILD/build.ninja" ] || [ "$(cat "$FLAGS_STAMP" 2>/dev/null)" != "$WANT" ]; then
    log "configuring ($WANT)"
    rm -rf "$BUILD"
    PATH="$VENV/bin:$PATH" cmake -S "$SRC" -B "$BUILD" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=ON \
        -DCMAKE_C_FLAGS="$EXTRA_FLAGS" -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS" >"$LLAMACPP_HOME/configure.log"
    echo "$WANT" >"$FLAGS_STAMP"
fi
log "building ${TARGETS[*]} (-j$JOBS; ninja skips what is up to date)"
PATH="$VENV/bin:$PATH" nice -n "${NICE:-10}" ninja -C "$BUILD" -j "$JOBS" "${TARGETS[@]}" \
    >"$LLAMACPP_HOME/build.log"

# 4. smoke check: every binary runs
for t in "${TARGETS[@]}"; do
    [ -x "$BUILD/bin/$t" ] || { log "missing $BUILD/bin/$t (see $LLAMACPP_HOME/build.log)"; exit 1; }
done
"$BUILD/bin/llama-bench" --help >/dev/null
VER="$("$BUILD/bin/llama-server" --version 2>&1 | grep -m1 -i version || true)"

cat <<MSG
setup_llamacpp: ready (llama.cpp from llama-cpp-python $VERSION; $VER).
  binaries:  $BUILD/bin  (${TARGETS[*]})
  AMX off:   $NO_AMX
  compare:   export LLAMACPP_BIN=$BUILD/bin
             .venv/bin/python benches/peers/llamacpp_compare.py --gguf MODEL.gguf --threads 1
             (without LLAMACPP_BIN the driver looks in the default LLAMACPP_HOME's build/bin)
MSG
