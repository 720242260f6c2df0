# Sourced by the engine install scripts: the cache they fill, their logger, one install at a time.
#
#   source "$(dirname "${BASH_SOURCE[0]}")/../cache.sh" vllm/install   # the name prefixes its log lines
#
# Sets PYTHON (default: python3 on PATH) and CACHE_ROOT (${ACTORPROXY_CACHE:-~/.cache/actorproxy});
# defines log (to stderr, as stdout carries the script's answer) and lock_cache.

PYTHON="${PYTHON:-python3}"
CACHE_ROOT="${ACTORPROXY_CACHE:-$HOME/.cache/actorproxy}"
CACHE_LOG_NAME="$1"

log() { echo "[$CACHE_LOG_NAME] $*" >&2; }

lock_cache() {  # $1: the lock file; holds it (fd 9) until the script exits
    # A test run and CI may start the same install together: the second waits, then finds the cache filled.
    mkdir -p "$(dirname "$1")"
    exec 9>"$1"
    flock 9
}
