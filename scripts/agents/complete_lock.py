"""Add the lock entries npm leaves out when the registry lacks some platform binaries.

``npm install --package-lock-only`` records a package's platform-specific optional
dependencies only when the registry serves them; a partial mirror (this project's CI
has one) then yields a lock that ``npm ci`` refuses as "out of sync". Each missing
entry is added as an optional, platform-restricted package with no tarball: ``npm ci``
skips it on other platforms and fetches it by name and version where it applies.

Run by ``install.sh --relock`` after the lock is regenerated.
"""

import json
import sys
from pathlib import Path

_OS = {"darwin": "darwin", "linux": "linux", "windows": "win32", "win32": "win32"}


def complete(lock: dict) -> list[str]:
    packages = lock["packages"]
    added = []
    for entry in list(packages.values()):
        for name, version in (entry.get("optionalDependencies") or {}).items():
            if f"node_modules/{name}" in packages or version.startswith("npm:"):
                continue
            parts = name.split("/")[-1].split("-")
            os_name = next((_OS[p] for p in parts if p in _OS), None)
            cpu = next((p for p in parts if p in ("x64", "arm64", "ia32", "arm")), None)
            stub: dict = {"version": version, "optional": True}
            if os_name:
                stub["os"] = [os_name]
            if cpu:
                stub["cpu"] = [cpu]
            if "musl" in parts:
                stub["libc"] = ["musl"]
            packages[f"node_modules/{name}"] = stub
            added.append(f"{name}@{version}")
    lock["packages"] = dict(sorted(packages.items()))
    return added


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("package-lock.json"))
    lock = json.loads(path.read_text())
    for name in complete(lock):
        print("added", name, file=sys.stderr)
    path.write_text(json.dumps(lock, indent=2) + "\n")
