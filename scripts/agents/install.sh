#!/usr/bin/env bash
# The real agent clients for tests/agents: Claude Code, Codex, opencode, Qwen Code and the Vercel AI SDK
# (`ai`, `@ai-sdk/openai`, `@ai-sdk/anthropic`), installed with `npm ci` from the pinned package-lock.json
# under Node.js $NODE_VERSION, into a cache directory reused while the lock (and that version) is unchanged.
#
#   scripts/agents/install.sh            # pinned versions -> $CACHE/<lock hash>
#   scripts/agents/install.sh --latest   # today's newest versions -> $CACHE/latest-<UTC date>
#   scripts/agents/install.sh --relock   # re-resolve package.json's versions into package-lock.json
#   scripts/agents/install.sh --node     # only Node.js; prints its bin directory
#
# Prints the directory whose node_modules/.bin holds the CLIs and `node` itself (stdout's only line):
# put that .bin first on PATH, since the CLIs start with `#!/usr/bin/env node`.
# $CACHE is $ACTORPROXY_AGENTS_CACHE, else ~/.cache/actorproxy/agents. npm's output goes to stderr.
#
# Node.js: the newest CLIs and SDKs need Node >= 22, and under an older node `npm install` quietly
# picks old releases. Debian's is 18 (nodesource's 20 on some hosts), so Node $NODE_VERSION comes from
# the npm registry's `node-linux-<arch>` package (the official binary, the package the `node` package
# installs), unpacked once per machine into $CACHE/node-$NODE_VERSION.
set -euo pipefail
NODE_VERSION=22.23.3
here="$(cd "$(dirname "$0")" && pwd)"
root="${ACTORPROXY_AGENTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/actorproxy/agents}"
# Quiet, non-interactive npm; engine checks are strict so that a wrong node fails instead of picking old releases.
export npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false \
    npm_config_engine_strict=true npm_config_loglevel=error

mkdir -p "$root"
# One install at a time (two test runs may start together); the second then finds it done.
exec 9>"$root/.lock"
flock 9
source "$here/../cache.sh" agents/install  # (its prune_superseded)
HASH_DIRS="$(printf '[0-9a-f]%.0s' {1..16})"  # (a glob: the installs of a lock, named by its hash)

install_node() {  # Node.js $NODE_VERSION into $root/node-$NODE_VERSION/bin (once)
    local dir="$root/node-$NODE_VERSION" arch
    if [[ -x "$dir/bin/node" ]]; then return; fi
    case "$(uname -m)" in
        x86_64) arch=x64 ;; aarch64|arm64) arch=arm64 ;;
        *) echo "install.sh: no Node.js package for $(uname -m)" >&2; exit 1 ;;
    esac
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
    (cd "$dir.tmp" && npm pack --silent "node-linux-$arch@$NODE_VERSION" >&2 \
        && tar xzf "node-linux-$arch-$NODE_VERSION.tgz" package/bin/node \
        && mkdir bin && mv package/bin/node bin/node && rm -rf package ./*.tgz)
    [[ "$("$dir.tmp/bin/node" --version)" == "v$NODE_VERSION" ]] || { echo "install.sh: bad node" >&2; exit 1; }
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
}

install_node
prune_superseded "$root/node-$NODE_VERSION" "$root"/node-*
node_bin="$root/node-$NODE_VERSION/bin"
# npm itself (a script run by `node`) then sees Node $NODE_VERSION and resolves releases for it.
export PATH="$node_bin:$PATH"

install_into() {  # $1: the final directory; the rest: the npm command to run in it
    local dir="$1"; shift
    if [[ -f "$dir/.installed" ]]; then return; fi
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
    cp "$here/package.json" "$here/package-lock.json" "$dir.tmp/"
    if [[ "$1" != "ci" && "${2:-}" != "ci" ]]; then rm "$dir.tmp/package-lock.json"; fi
    (cd "$dir.tmp" && "$@" >&2)
    ln -sf "$node_bin/node" "$dir.tmp/node_modules/.bin/node"
    touch "$dir.tmp/.installed"
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
}

case "${1:-}" in
    --node)
        echo "$node_bin"; exit 0 ;;
    --relock)
        (cd "$here" && rm -f package-lock.json && npm install --package-lock-only >&2 \
            && python3 complete_lock.py package-lock.json)
        exit 0 ;;
    --latest)
        dir="$root/latest-$NODE_VERSION-$(date -u +%Y%m%d)"
        install_into "$dir" npm install --no-package-lock \
            $(python3 -c 'import json,sys; print(" ".join(f"{n}@latest" for n in json.load(open(sys.argv[1]))["dependencies"]))' "$here/package.json")
        prune_superseded "$dir" "$root"/latest-* ;;
    "")
        dir="$root/$(cat "$here/package-lock.json" <(echo "node $NODE_VERSION") | sha256sum | cut -c1-16)"
        install_into "$dir" npm ci
        prune_superseded "$dir" "$root"/$HASH_DIRS ;;
    *) echo "usage: $0 [--latest | --relock | --node]" >&2; exit 2 ;;
esac
echo "$dir"
