"""``python -m actorproxy.workers.child DIR INDEX READY_FD LIFE_FD``: one worker process, started by the supervisor.

The settings come pickled in ``DIR/config.pickle`` (port already chosen). When the worker
serves, it writes ``ready <url>`` to ``READY_FD`` and closes it; a worker that cannot start
prints one line and exits 2, as ``actorproxy run`` does. ``LIFE_FD`` is the read end of a
pipe the supervisor never writes to: its end of file means the supervisor is gone, and the
worker then drains and exits as on SIGTERM. (Not ``PR_SET_PDEATHSIG``: it fires when the
*thread* that started the child exits, and Trio starts processes from its worker threads.)
A supervisor that is gone (killed: SIGKILL, the OOM killer) cannot remove ``DIR``, whose
settings hold the proxy's secrets: each of its workers removes it as it exits. The others
need nothing from it by then: their sockets are bound, and one that hands a connection to
a worker that has left gets the 503 it would get from that worker's socket.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import sys
from collections.abc import Callable
from functools import partial

import trio

from ..config import ProxyConfig
from ..errors import StartupError
from ..logs import configure_logging
from ..runtime import freed_memory
from ..serve import RunningProxy, serve_until_signal
from ..startup import load_tokenizer_checked, startup_failure
from ..tokenization.tokenizer import ChatTokenizer
from .worker import serve_worker


async def _serve(config: ProxyConfig, tokenizer: ChatTokenizer, index: int, directory: str, ready_fd: int,
                 life_fd: int, gone: Callable[[], None]) -> None:
    serve = partial(serve_worker, index=index, directory=directory)
    async with trio.open_nursery() as outer:
        outer.start_soon(_watch_supervisor, life_fd, gone)
        async with trio.open_nursery() as nursery:
            running: RunningProxy = await nursery.start(partial(serve_until_signal, config, tokenizer=tokenizer,
                                                                serve=serve))
            os.write(ready_fd, f"ready {running.url}\n".encode())
            os.close(ready_fd)
        outer.cancel_scope.cancel()


async def _watch_supervisor(life_fd: int, gone: Callable[[], None]) -> None:
    """At the end of file of the supervisor's pipe (it exited, even by SIGKILL): drain and exit, as on SIGTERM."""
    async with trio.lowlevel.FdStream(life_fd) as pipe:
        while await pipe.receive_some(64):
            pass
    gone()
    logging.getLogger("actorproxy.workers").warning("the supervisor is gone: this worker drains and exits")
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    freed_memory.limit_heaps()  # before any thread (the tokenizer's too) makes a heap of its own
    directory, index, ready_fd, life_fd = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    with open(os.path.join(directory, "config.pickle"), "rb") as file:
        config: ProxyConfig = pickle.load(file)
    configure_logging(config.server.log_level, config.server.log_format)
    logging.getLogger("actorproxy").info("worker %d of %d starting (pid %d)", index, config.server.workers,
                                         os.getpid())
    orphaned = False

    def gone() -> None:
        nonlocal orphaned
        orphaned = True

    try:
        tokenizer = load_tokenizer_checked(config.engines.tokenizer_path)
        trio.run(_serve, config, tokenizer, index, directory, ready_fd, life_fd, gone)
    except BaseException as exc:  # a start-up failure arrives wrapped in exception groups
        failure = exc if isinstance(exc, StartupError) else startup_failure(exc, config)
        if failure is None:
            raise
        print(f"actorproxy: worker {index}: {failure}", file=sys.stderr)
        return 2
    finally:
        if orphaned:  # no supervisor will remove it (see the module doc)
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
