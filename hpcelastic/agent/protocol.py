"""Wire format of the control plane: length-prefixed JSON frames authenticated with HMAC-SHA256.

Hand-written because no library offers an authenticated, pickle-free, dependency-free framing that
both a ``selectors`` server and a blocking client can share; the whole format fits on this page.

Frame: ``u32 length | 32-byte MAC | JSON body`` (length counts MAC + body).

Handshake (one round trip, mutual authentication):

1. server -> client, plain (MAC of zeros): ``{"t": "challenge", "nonce": SN, "v": 1}``
2. client -> server, authenticated: ``{"t": "hello", "nonce": CN, ...}``
3. both sides use the session key ``HMAC(secret, "hpcelastic/1|" + SN + "|" + CN)``; the server answers
   ``welcome`` (authenticated) or a plain ``error`` frame and closes.

Every authenticated frame's MAC covers a direction byte, a per-direction sequence number and the
body, so a frame replayed on the same connection (wrong sequence), reflected back (wrong direction)
or replayed on another connection (other nonces, other key) is rejected. Messages are never
unpickled: bodies are JSON objects only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
from typing import Any

PROTOCOL_VERSION = 1
MAX_FRAME = 1 << 20
MAC_LEN = 32
_LEN = struct.Struct("!I")
_SEQ = struct.Struct("!Q")
_ZERO_MAC = bytes(MAC_LEN)
NONCE_BYTES = 16


class ProtocolError(Exception):
    """A malformed, oversized or out-of-order frame."""


class AuthError(ProtocolError):
    """A frame whose MAC does not verify: wrong secret, tampering or replay."""


def new_nonce() -> str:
    """A fresh random nonce, hex encoded."""
    return secrets.token_hex(NONCE_BYTES)


def session_key(secret: str, server_nonce: str, client_nonce: str) -> bytes:
    """The per-connection key both sides derive from the job secret and the two nonces."""
    material = f"hpcelastic/{PROTOCOL_VERSION}|{server_nonce}|{client_nonce}".encode()
    return hmac.new(secret.encode(), material, hashlib.sha256).digest()


#: One encoder for every frame: ``json.dumps`` with options builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)


def _dumps(msg: dict[str, Any]) -> bytes:
    return _ENCODER.encode(msg).encode()


def _loads(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"frame is not JSON: {e}") from None
    except RecursionError:  # a hello is parsed before its MAC can be checked: anyone may send [[[[...
        raise ProtocolError("frame is JSON nested too deeply") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise ProtocolError("frame is not a JSON object with a type")
    return obj


def _frame(mac: bytes, body: bytes) -> bytes:
    if len(body) + MAC_LEN > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME} byte frame limit")
    return _LEN.pack(MAC_LEN + len(body)) + mac + body


def encode_plain(msg: dict[str, Any]) -> bytes:
    """An unauthenticated frame (challenge and rejection only)."""
    return _frame(_ZERO_MAC, _dumps(msg))


def split_payload(payload: bytes) -> tuple[bytes, dict[str, Any]]:
    """Split a frame payload into its MAC and parsed body (body not yet trusted)."""
    if len(payload) < MAC_LEN:
        raise ProtocolError("frame shorter than its MAC")
    return payload[:MAC_LEN], _loads(payload[MAC_LEN:])


def decode_plain(payload: bytes) -> dict[str, Any]:
    """Parse an unauthenticated frame; its MAC field must be zeros."""
    mac, msg = split_payload(payload)
    if mac != _ZERO_MAC:
        raise ProtocolError("expected an unauthenticated frame")
    return msg


class Session:
    """Authenticated framing of one connection once the key is known (one object per side)."""

    def __init__(self, key: bytes, *, is_server: bool) -> None:
        #: The keyed HMAC state, copied per frame: keying a new HMAC costs more than the frame's hash.
        self._key = key
        self._keyed = hmac.new(key, digestmod=hashlib.sha256)
        self._send_dir = b"S" if is_server else b"C"
        self._recv_dir = b"C" if is_server else b"S"
        self._send_seq = 0
        self._recv_seq = 0

    def derive(self, label: str) -> bytes:
        """A key for another use of this connection (its liveness probes), derived from its session key."""
        return hmac.new(self._key, f"hpcelastic/{label}".encode(), hashlib.sha256).digest()

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        mac = self._keyed.copy()
        mac.update(direction + _SEQ.pack(seq) + body)
        return mac.digest()

    def encode(self, msg: dict[str, Any]) -> bytes:
        """Frame ``msg`` with the next outgoing sequence number."""
        body = _dumps(msg)
        frame = _frame(self._mac(self._send_dir, self._send_seq, body), body)
        self._send_seq += 1
        return frame

    def decode(self, payload: bytes) -> dict[str, Any]:
        """Verify and parse one incoming frame; :class:`AuthError` if it does not verify."""
        if len(payload) < MAC_LEN:
            raise ProtocolError("frame shorter than its MAC")
        mac, body = payload[:MAC_LEN], payload[MAC_LEN:]
        if not hmac.compare_digest(mac, self._mac(self._recv_dir, self._recv_seq, body)):
            raise AuthError("frame failed authentication (wrong secret, tampered or replayed)")
        self._recv_seq += 1
        return _loads(body)


class FrameBuffer:
    """Incremental splitter of a byte stream into frame payloads (for non-blocking readers)."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        #: Longer frames are refused before they are buffered (small until a connection is authenticated).
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return the complete payloads now available."""
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= _LEN.size:
            (length,) = _LEN.unpack_from(self._buf)
            if length > self.max_frame or length < MAC_LEN:
                raise ProtocolError(f"bad frame length {length}")
            if len(self._buf) < _LEN.size + length:
                break
            out.append(bytes(self._buf[_LEN.size : _LEN.size + length]))
            del self._buf[: _LEN.size + length]
        return out


def recv_payload(sock: socket.socket) -> bytes:
    """Read one frame payload from a blocking socket; ``ConnectionError`` on EOF."""
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > MAX_FRAME or length < MAC_LEN:
        raise ProtocolError(f"bad frame length {length}")
    return _recv_exact(sock, length)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        data = sock.recv(n - len(chunks))
        if not data:
            raise ConnectionError("connection closed by peer")
        chunks += data
    return bytes(chunks)


def client_handshake(
    sock: socket.socket, secret: str, hello: dict[str, Any]
) -> tuple[Session, dict[str, Any]]:
    """Run the client side of the handshake on a connected blocking socket.

    Returns the session and the server's ``welcome`` message. Raises :class:`AuthError` when the
    server rejects the secret or cannot prove it knows it, :class:`ProtocolError` on a refusal.
    """
    session, hello_frame = client_hello(secret, recv_payload(sock), hello)
    sock.sendall(hello_frame)
    return session, client_welcome(session, recv_payload(sock))


def client_hello(secret: str, challenge_payload: bytes, hello: dict[str, Any]) -> tuple[Session, bytes]:
    """Answer the server's challenge: the client session and the ``hello`` frame to send.

    Step 2 of the handshake without I/O, so non-blocking clients (the load benchmark) share it.
    """
    challenge = decode_plain(challenge_payload)
    if challenge.get("t") != "challenge" or not isinstance(challenge.get("nonce"), str):
        raise ProtocolError(f"expected a challenge, got {challenge.get('t')!r}")
    if challenge.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"coordinator speaks protocol {challenge.get('v')}, this agent {PROTOCOL_VERSION}"
        )
    client_nonce = new_nonce()
    session = Session(session_key(secret, challenge["nonce"], client_nonce), is_server=False)
    return session, session.encode({**hello, "t": "hello", "nonce": client_nonce})


def client_welcome(session: Session, payload: bytes) -> dict[str, Any]:
    """Check the server's answer to ``hello``: its ``welcome`` message, or the refusal raised."""
    mac, msg = split_payload(payload)
    if mac == _ZERO_MAC and msg.get("t") == "error":
        err = str(msg.get("error", "rejected"))
        raise (AuthError(err) if msg.get("auth") else ProtocolError(err))
    reply = session.decode(payload)
    if reply.get("t") != "welcome":
        raise ProtocolError(f"expected welcome, got {reply.get('t')!r}")
    return reply


def server_accept_hello(secret: str, server_nonce: str, payload: bytes) -> tuple[Session, dict[str, Any]]:
    """Verify a client's first frame against the challenge this server sent.

    Returns the server-side session and the hello message; :class:`AuthError` if the client does
    not know the secret.
    """
    _mac, msg = split_payload(payload)
    if msg.get("t") != "hello" or not isinstance(msg.get("nonce"), str):
        raise ProtocolError("first frame is not a hello")
    session = Session(session_key(secret, server_nonce, msg["nonce"]), is_server=True)
    return session, session.decode(payload)
