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

prune_superseded() {  # $1: the entry in use; the rest: every entry of its kind (a glob, expanded by the caller)
    # Each version of an install (a vLLM venv, the SGLang source, a llama.cpp build, an npm lock's or a Python's
    # clients) gets an entry of its own, and a bump leaves the old one behind: a vLLM venv is 3.4 GB. Kept: the
    # one in use (marked used now) and the one used last before it, which a checkout of the previous revision
    # may be testing with; the others are removed. Call it holding the install's lock.
    local keep="$1" entry kept=0
    shift
    touch "$keep"
    while IFS= read -r entry; do
        entry="${entry#* }"
        [[ "$entry" -ef "$keep" ]] && continue
        if (( kept == 0 )); then kept=1; continue; fi
        log "removing $entry (superseded)"
        rm -rf "$entry"
    done < <(for entry in "$@"; do [[ -d "$entry" ]] && stat -c '%Y %n' "$entry"; done | sort -rn)
}
