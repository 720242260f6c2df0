"""The C allocator's memory: what drains free goes back to the system, and threads do not multiply heaps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from actorproxy.runtime import freed_memory

# In a process of its own (the test process's threads already made their heaps): a runtime opened, then
# eight threads alive at once, each allocating; how many heaps glibc keeps, before and after.
_SCRIPT = textwrap.dedent('''
    import ctypes, tempfile, threading, trio
    from actorproxy.config import ProxyConfig
    from actorproxy.runtime.runtime import open_runtime
    from actorproxy.sim import SimConfig, SimEngine
    from actorproxy.tokenization import load_tokenizer

    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc.restype = ctypes.c_void_p

    def heaps():
        with tempfile.NamedTemporaryFile("r") as out:
            stream = libc.fopen(out.name.encode(), b"w")
            libc.malloc_info(0, stream)
            libc.fclose(stream)
            return out.read().count("<heap nr=")

    async def main():
        tok = load_tokenizer(None)
        async with open_runtime(ProxyConfig.of(port=0), backend=SimEngine(tok, SimConfig(seed=1)), tokenizer=tok):
            before = heaps()
            together = threading.Barrier(9)
            def allocate():
                libc.malloc(1000)
                together.wait()  # all eight alive at once
                together.wait()
            threads = [threading.Thread(target=allocate) for _ in range(8)]
            for thread in threads:
                thread.start()
            together.wait()
            after = heaps()
            together.wait()
            for thread in threads:
                thread.join()
        print(before, after)

    trio.run(main)
''')


@pytest.mark.skipif(freed_memory.give_back() is False, reason="no glibc allocator")
def test_threads_share_a_bounded_number_of_heaps() -> None:
    """Issue 33: each new thread (the offload threads, the store's) got a heap of its own, up to 8 per core;
    what a drain freed in them stayed resident, and RSS crept up from drain to drain (~20 MiB over
    30,000 turns in memory_drains.py). The runtime bounds them at ``freed_memory.ARENAS``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    before, after = map(int, done.stdout.split())
    assert after <= max(before, 2), (before, after)
