#!/usr/bin/env bash
# Unpack the Python source of a pinned SGLang release into a cache that later runs reuse: the
# contract test (tests/contracts/test_sglang_contract.py) holds our SGLang client to that release's own
# request and reply types. Nothing here runs SGLang (it needs a GPU): the wheel is taken from
# PyPI without its dependencies, checked against its sha256, and only its .py files are kept.
#
#   scripts/sglang/install.sh            # prints the path when done:  source=...
#
# Cache: ${ACTORPROXY_CACHE:-~/.cache/actorproxy}/sglang-src-<version>/sglang/...
#        (plus sglang-<version>.dist-info/METADATA; ~60 MB, 39 MB downloaded once)
# Environment: PYTHON (default: python3 on PATH, needs pip).
set -euo pipefail

SGLANG_VERSION="0.5.23"
WHEEL="sglang-$SGLANG_VERSION-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256="00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
source "$(dirname "${BASH_SOURCE[0]}")/../cache.sh" sglang/install
DEST="$CACHE_ROOT/sglang-src-$SGLANG_VERSION"

lock_cache "$CACHE_ROOT/.sglang-src.lock"
if [[ -f "$DEST/.complete" ]]; then
    log "sglang $SGLANG_VERSION source cached at $DEST"
    prune_superseded "$DEST" "$CACHE_ROOT"/sglang-src-*
    echo "source=$DEST"
    exit 0
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/sglang-src.XXXXXX")"
trap 'rm -rf "$work"' EXIT
log "downloading $WHEEL (no dependencies)"
# The wheel is for CPython 3.11 on x86-64 Linux; only its source is read, so the interpreter
# that downloads it may be any.
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --implementation cp --abi cp311 --platform manylinux_2_34_x86_64 \
    "sglang==$SGLANG_VERSION" -d "$work" >&2
if ! echo "$WHEEL_SHA256  $work/$WHEEL" | sha256sum --check --status; then
    log "$WHEEL has the wrong sha256 (want $WHEEL_SHA256)"
    exit 1
fi
"$PYTHON" - "$work/$WHEEL" "$work/src" <<'PY'
import sys, zipfile
from pathlib import Path
wheel, out = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.endswith(".py") or name.endswith(".dist-info/METADATA"):
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
PY
echo "$SGLANG_VERSION $WHEEL_SHA256" >"$work/src/.complete"
rm -rf "$DEST" && mv "$work/src" "$DEST"
log "unpacked $DEST"
prune_superseded "$DEST" "$CACHE_ROOT"/sglang-src-*
echo "source=$DEST"
