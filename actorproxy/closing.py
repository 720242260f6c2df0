"""``with`` and ``async with`` for an object that closes: one piece of plumbing for every such class."""

from __future__ import annotations

from typing import Self


class Closing:
    """Both ``with`` and ``async with`` give the object itself and close it on the way out.

    A subclass implements :meth:`close`; ``async with`` closes through :meth:`aclose`, which is
    :meth:`close` unless the subclass has a way that does not block the event loop.
    """

    def close(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
