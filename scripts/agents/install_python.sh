#!/usr/bin/env bash
# The Python agent clients for tests/agents that bring dependencies of their own (mini-swe-agent and
# LiteLLM, which it calls models through; LangGraph and LangChain; smolagents): a venv of their own,
# installed from the pinned python-clients.txt into a cache directory reused while that file (and the
# Python) is unchanged.
# They run as their users run them, as a program beside the proxy, not inside the test venv.
#
#   scripts/agents/install_python.sh     # prints the venv's python (stdout's only line); pip's output to stderr
#
# The cache is $ACTORPROXY_AGENTS_CACHE, else ~/.cache/actorproxy/agents (as install.sh's).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="${ACTORPROXY_AGENTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/actorproxy/agents}"
python="${PYTHON:-python3}"
mkdir -p "$root"
# One install at a time (two test runs may start together); the second then finds it done.
exec 9>"$root/.lock-python"
flock 9
source "$here/../cache.sh" agents/install_python  # (its prune_superseded)

dir="$root/py-$(cat "$here/python-clients.txt" <("$python" --version) | sha256sum | cut -c1-16)"
if [[ ! -f "$dir/.installed" ]]; then
    rm -rf "$dir.tmp"
    "$python" -m venv "$dir.tmp"
    "$dir.tmp/bin/pip" install --quiet --disable-pip-version-check -r "$here/python-clients.txt" >&2
    touch "$dir.tmp/.installed"
    rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
prune_superseded "$dir" "$root"/py-*
echo "$dir/bin/python"
