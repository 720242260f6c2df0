"""Where one HTTP/1.1 connection stands, sans-IO, for both roles: one :class:`ConnectionState` per connection.

The codec (:mod:`.h1`) reads and writes heads and bodies; this object records what they
mean for the connection, in h11's model: each side (the client's request, the server's
response) has a state, moved by the events the codec reports, and the questions the I/O
classes ask are answered from the two states instead of from flags of their own.

====================  =================================================================================
client (the request)  ``IDLE`` -head-> ``SEND_BODY`` -body's end-> ``DONE`` (a bodiless request: at once)
server (the response) ``IDLE`` -request head-> ``SEND_RESPONSE`` -response head (not 1xx)-> ``SEND_BODY``
                      -body's end-> ``DONE``
====================  =================================================================================

A side that reaches ``DONE`` when the connection is not kept alive (either head said
``close``, HTTP/1.0, a framing that ends with the connection, a refusal) is ``MUST_CLOSE``
instead, and one ``DONE`` turns ``MUST_CLOSE`` when keep-alive ends later. A side whose
message broke (a bad chunk, a truncated body, a reply cut short) is ``ERROR``; one whose
peer closed (or that closed) when nothing was under way is ``CLOSED``. When both are
``DONE`` the exchange is over and the connection may carry the next one
(:meth:`ConnectionState.next_cycle` makes both ``IDLE`` again; it refuses otherwise).

An event a state does not allow is a :class:`~.errors.ProtocolError` (a second request
head before the response, a response with no request, a body's end twice): the I/O class
has a bug or the peer broke HTTP, and either way the connection ends.

What it does not model: several requests under way on one client connection at once
(:class:`~.oneshot.Pipeline` writes its requests ahead and records each exchange as its
answer is read: the request as gone out whole, then the answer), protocol switches (``101`` is
refused by the codec), and the transport (an EOF read ahead of the bytes still buffered,
a peer gone, a write that failed: the I/O classes know those).
"""

from __future__ import annotations

from .errors import ProtocolError

#: Waiting for a request head (client), or for a request to answer (server).
IDLE = "IDLE"
#: The request head is in; no response head has gone out yet (server only).
SEND_RESPONSE = "SEND_RESPONSE"
#: The head is out; the body is under way.
SEND_BODY = "SEND_BODY"
#: The message is whole, and the connection may carry another exchange.
DONE = "DONE"
#: The message is whole, and the connection closes after the exchange.
MUST_CLOSE = "MUST_CLOSE"
#: The connection closed with this side between messages.
CLOSED = "CLOSED"
#: This side's message broke: the connection cannot go on.
ERROR = "ERROR"

CLIENT = "client"
SERVER = "server"

#: States a side may close from without breaking a message.
_MAY_CLOSE = (IDLE, DONE, MUST_CLOSE, CLOSED)


class ConnectionState:
    """The two sides of one HTTP/1.1 connection (see the module's table); the I/O class of either role holds one.

    ``keep_alive``: both heads so far let the connection carry another exchange.
    ``expect_continue``: the request asked for ``100 Continue`` and no response has started.
    """

    __slots__ = ("client", "server", "keep_alive", "expect_continue")

    def __init__(self) -> None:
        self.client = IDLE
        self.server = IDLE
        self.keep_alive = True
        self.expect_continue = False

    def __repr__(self) -> str:
        return f"ConnectionState(client={self.client}, server={self.server}, keep_alive={self.keep_alive})"

    # -- the request (client side) ---------------------------------------------------------------------------------

    def request(self, keep_alive: bool, ended: bool, expect_continue: bool = False) -> None:
        """A request head went out or came in (``ended``: it has no body, or its body went with it whole)."""
        if self.client != IDLE or self.server != IDLE:
            raise ProtocolError(f"a request head while the connection is {self!r}")
        if not keep_alive:
            self.keep_alive = False
        self.expect_continue = expect_continue and not ended
        self.server = SEND_RESPONSE
        self.client = SEND_BODY if not ended else DONE if self.keep_alive else MUST_CLOSE

    def request_end(self) -> None:
        """The request's body ended (the codec's decoder is ``done``)."""
        if self.client != SEND_BODY:
            raise ProtocolError(f"the end of a request body while the connection is {self!r}")
        self.client = DONE if self.keep_alive else MUST_CLOSE

    # -- the response (server side) --------------------------------------------------------------------------------

    def response(self, keep_alive: bool, ended: bool = False) -> None:
        """A final (not 1xx) response head went out or came in (``ended``: its body went with it whole)."""
        if self.server != SEND_RESPONSE:
            raise ProtocolError(f"a response head while the connection is {self!r}")
        self.expect_continue = False
        if not keep_alive:
            self.close_after()
        self.server = SEND_BODY
        if ended:
            self.server = DONE if self.keep_alive else MUST_CLOSE

    def response_end(self) -> None:
        """The response's body ended whole."""
        if self.server != SEND_BODY:
            raise ProtocolError(f"the end of a response body while the connection is {self!r}")
        self.server = DONE if self.keep_alive else MUST_CLOSE

    # -- either side -----------------------------------------------------------------------------------------------

    def close_after(self) -> None:
        """The connection closes after this exchange (h11's keep-alive disabled): a side ``DONE`` is ``MUST_CLOSE``."""
        self.keep_alive = False
        if self.client == DONE:
            self.client = MUST_CLOSE
        if self.server == DONE:
            self.server = MUST_CLOSE

    def fail(self, role: str) -> None:
        """``role``'s message broke (its framing, its length, its peer): the connection cannot go on."""
        self._leave(role, ERROR)

    def closed(self, role: str) -> None:
        """``role``'s side closed: between messages it is ``CLOSED``; within one, its message broke."""
        if (self.client if role == CLIENT else self.server) not in _MAY_CLOSE:
            self.fail(role)
            raise ProtocolError(f"the {role} closed in the middle of its message")
        self._leave(role, CLOSED)

    def _leave(self, role: str, state: str) -> None:
        """``role``'s side is ``state`` for good; keep-alive ends (a ``DONE`` other side is ``MUST_CLOSE``)."""
        if role == CLIENT:
            self.client = state
        else:
            self.server = state
        self.close_after()

    def next_cycle(self) -> bool:
        """Whether the connection carries another exchange: when both messages are whole and keep-alive holds
        (``reusable``), both sides are ``IDLE`` again and it does; else nothing changes and it does not."""
        if self.client != DONE or self.server != DONE:
            return False
        self.client = self.server = IDLE
        return True

    # -- the answers -----------------------------------------------------------------------------------------------

    @property
    def reusable(self) -> bool:
        """The exchange is over and the connection may carry the next one (a server reads the next request on it;
        a client's goes back to the pool)."""
        return self.client == DONE and self.server == DONE

    @property
    def response_started(self) -> bool:
        """A response head (not 1xx) went out or came in."""
        return self.server != IDLE and self.server != SEND_RESPONSE

    @property
    def request_unread(self) -> bool:
        """The request's body did not end well: the client may still be sending it (close gently)."""
        return self.client == SEND_BODY or self.client == ERROR
