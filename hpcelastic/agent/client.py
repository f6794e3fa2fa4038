"""The agent's side of the control plane: one authenticated connection to the coordinator.

A reader thread hands every message to a callback as it arrives (events are pushed, never polled);
a heartbeat thread sends a heartbeat every ``heartbeat_interval`` and reports the coordinator lost
when nothing arrived for ``heartbeat_timeout`` seconds. Both keep running while the agent's main
thread is busy stopping workers.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from hpcelastic.agent import messages, protocol

RETRY_DELAY = 0.1
CHALLENGE_TIMEOUT = 5.0


class _NoChallenge(Exception):
    """The coordinator never sent its challenge on this connection: connect again."""


class CoordinatorUnreachable(Exception):
    """The coordinator did not accept a connection before the deadline."""


def _not_served(host: str, port: int, e: protocol.ProtocolError) -> str:
    """What to say about an answer on the coordinator's port that is no welcome (nothing in it is trusted)."""
    if isinstance(e, protocol.AuthError):
        return (
            f"the program at {host}:{port} rejected this agent or could not prove it knows the job's secret "
            f"({e}); every node must read the same secret (<run>/secret or $HPCELASTIC_SECRET)"
        )
    return f"the program at {host}:{port} is not this job's coordinator or refused this agent ({e})"


class CoordinatorClient:
    """Connects, authenticates, then delivers messages to ``on_message`` from its own thread."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: str,
        *,
        on_message: Callable[[messages.Message], None],
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 2.0,
    ) -> None:
        self.host, self.port = host, port
        self._secret = secret
        self._on_message = on_message
        self._hb_interval = heartbeat_interval
        self._hb_timeout = heartbeat_timeout
        self._sock: socket.socket | None = None
        self._session: protocol.Session | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._last_recv = time.monotonic()

    def connect(self, hello: messages.Hello, timeout: float) -> messages.Welcome:
        """Connect (retrying until ``timeout``) and authenticate; returns the welcome message.

        Raises :class:`CoordinatorUnreachable` only. A refusal or any answer that is not this job's
        coordinator (another program on the port, a forged unauthenticated error frame) is retried
        until ``timeout``: unauthenticated input never ends an agent sooner than an unreachable port.
        """
        deadline = time.monotonic() + timeout
        last_error = "no attempt"
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.5, min(5.0, timeout)))
            except OSError as e:
                last_error = e.strerror or str(e)
            else:
                try:
                    return self._handshake(sock, hello, deadline)
                except _NoChallenge:
                    last_error = f"no challenge within {CHALLENGE_TIMEOUT:g} s of connecting"
                except protocol.ProtocolError as e:
                    last_error = _not_served(self.host, self.port, e)
            if time.monotonic() + RETRY_DELAY >= deadline:
                raise CoordinatorUnreachable(
                    f"cannot reach the coordinator at {self.host}:{self.port} within {timeout:g} s "
                    f"({last_error})"
                )
            time.sleep(RETRY_DELAY)

    def _handshake(self, sock: socket.socket, hello: messages.Hello, deadline: float) -> messages.Welcome:
        """Authenticate on a fresh connection; keeps it as this client's connection on success.

        A connection the coordinator never serves (its accept queue overflowed while thousands of
        agents connected at once: the kernel may then drop the connection after our side saw it
        established) sends no challenge; :class:`_NoChallenge` lets ``connect`` retry. Once our
        hello is sent the node may have joined, so a silent or closed connection after that is
        :class:`CoordinatorUnreachable`, not a retry.
        """
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(0.1, min(CHALLENGE_TIMEOUT, deadline - time.monotonic())))
            try:
                challenge = protocol.recv_payload(sock)
            except OSError:
                raise _NoChallenge from None
            sock.settimeout(max(1.0, deadline - time.monotonic()))
            session, hello_frame = protocol.client_hello(self._secret, challenge, messages.encode(hello))
            sock.sendall(hello_frame)
            welcome = messages.Welcome.from_wire(
                protocol.client_welcome(session, protocol.recv_payload(sock))
            )
            # Reads and writes give up after this long: a hung coordinator cannot block the agent.
            sock.settimeout(self._hb_timeout + 1.0)
        except OSError as e:
            sock.close()
            raise CoordinatorUnreachable(
                f"the coordinator at {self.host}:{self.port} stopped answering during the handshake "
                f"({e.strerror or e or type(e).__name__})"
            ) from None
        except (protocol.ProtocolError, _NoChallenge):
            sock.close()
            raise
        self._sock, self._session = sock, session
        self._last_recv = time.monotonic()
        return welcome

    def start(self) -> None:
        """Start the reader and heartbeat threads."""
        threading.Thread(target=self._reader, name="hpcelastic-client-reader", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="hpcelastic-client-heartbeat", daemon=True).start()

    def send(self, msg: messages.Message) -> bool:
        """Send one message; False when the connection is gone (the loss is reported separately)."""
        if self._sock is None or self._session is None or self._closed.is_set():
            return False
        with self._lock:
            try:
                self._sock.sendall(self._session.encode(messages.encode(msg)))
            except OSError:
                return False
        return True

    def close(self) -> None:
        """Close the connection; no loss is reported after this."""
        self._closed.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    def _lost(self, reason: str) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._on_message(messages.Lost(reason))

    def _reader(self) -> None:
        assert self._sock is not None and self._session is not None
        try:
            while True:
                wire = self._session.decode(protocol.recv_payload(self._sock))
                self._last_recv = time.monotonic()
                msg = messages.decode(messages.FROM_COORDINATOR, wire)
                if msg is not None and not isinstance(msg, messages.Heartbeat):
                    self._on_message(msg)
        except (OSError, ConnectionError):
            self._lost("connection to the coordinator closed")
        except protocol.ProtocolError as e:
            self._lost(f"bad frame from the coordinator: {e}")
        except messages.InvalidMessage as e:
            self._lost(f"bad message from the coordinator: {e}")

    def _heartbeat(self) -> None:
        while not self._closed.wait(self._hb_interval):
            silent = time.monotonic() - self._last_recv
            if silent > self._hb_timeout:
                self._lost(f"no heartbeat from the coordinator for {silent:.1f} s")
                return
            self.send(messages.Heartbeat())
