"""Tokens, roles and the challenge-response that proves them, without sending a secret.

A hub has one **master token** (what ``rtop serve`` makes and its discovery file holds;
``RTOP_TOKEN``). Three **role tokens** are derived from it, one per role::

    role_token(master, role) = "rtop-<role>-" + urlsafe-b64(HMAC-SHA256(master,
                                                 "rtop-role-v1:" + role))[:32]

* ``ingest``: ranks (``collectors``), which stream records to the hub;
* ``view``: viewers (``rtop``, ``rtop status``) and Prometheus (``/metrics``);
* ``control``: whoever acts on the job (profiling, stacks, link probes).

The master token yields the key of every role; a role token only its own
(:func:`key_for`), so the view token given to Prometheus can never act on a job.

Neither side ever sends a token. A peer connects and says ``hello`` with its ``role``
and a fresh random ``nonce`` Nc; the hub answers ``challenge`` with its own nonce Ns and
:func:`hub_proof`; the peer checks it (so it talks only to a hub that holds the token)
and answers ``auth`` with :func:`client_proof`; the hub checks that and says
``welcome``. Each proof is an HMAC-SHA256 over both nonces, keyed by the role's key and
labelled with the side that makes it, so neither can be replayed or reflected.

Standard library only: this runs inside training processes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Final

#: The roles a token can grant.
ROLES: Final = ("ingest", "view", "control")
#: The key role each ``hello`` role authenticates with.
HELLO_ROLES: Final = {"rank": "ingest", "viewer": "view", "control": "control"}
#: Bytes of a fresh nonce; a peer's nonce must have at least this many.
NONCE_BYTES: Final = 16
#: The most bytes of a nonce that is accepted.
MAX_NONCE_BYTES: Final = 64
#: Characters of a role token after its ``rtop-<role>-`` prefix.
ROLE_TOKEN_CHARS: Final = 32

_LABEL: Final = b"rtop-auth-v1|"
_ROLE_DERIVE: Final = "rtop-role-v1:"
_KEY_DERIVE: Final = b"rtop-key-v1|"


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")


def role_token(master: str, role: str) -> str:
    """The token of ``role`` derived from the ``master`` token (see the module doc)."""
    _check_role(role)
    mac = hmac.new(master.encode(), (_ROLE_DERIVE + role).encode(), hashlib.sha256).digest()
    return f"rtop-{role}-" + base64.urlsafe_b64encode(mac).decode()[:ROLE_TOKEN_CHARS]


def token_role(token: str) -> str | None:
    """The role a role token grants, or None for a master token."""
    for role in ROLES:
        prefix = f"rtop-{role}-"
        if token.startswith(prefix) and len(token) == len(prefix) + ROLE_TOKEN_CHARS:
            return role
    return None


def _key(role_tok: str) -> bytes:
    return hashlib.sha256(_KEY_DERIVE + role_tok.encode()).digest()


def key_for(token: str | None, role: str) -> bytes | None:
    """The key that authenticates ``role`` with ``token``, or None if it cannot.

    A master token yields every role's key; a role token only its own role's (a view
    token never yields the control key). An empty or missing token yields none.
    """
    _check_role(role)
    if not token:
        return None
    own = token_role(token)
    if own is None:
        return _key(role_token(token, role))
    return _key(token) if own == role else None


def new_nonce() -> bytes:
    """A fresh random nonce for one handshake."""
    return secrets.token_bytes(NONCE_BYTES)


def valid_nonce(nonce: object) -> bool:
    """Whether a peer's nonce is bytes of an acceptable length."""
    return isinstance(nonce, bytes) and NONCE_BYTES <= len(nonce) <= MAX_NONCE_BYTES


def _mac(key: bytes, side: bytes, role: str, first: bytes, second: bytes) -> bytes:
    msg = _LABEL + side + b"|" + role.encode() + b"|" + first + b"|" + second
    return hmac.new(key, msg, hashlib.sha256).digest()


def hub_proof(key: bytes, role: str, client_nonce: bytes, hub_nonce: bytes) -> bytes:
    """What the hub sends in its ``challenge``: HMAC(key, "rtop-auth-v1|hub|" + role +
    "|" + Nc + "|" + Ns). ``role`` is the hello's (``rank``, ``viewer``, ``control``)."""
    return _mac(key, b"hub", role, client_nonce, hub_nonce)


def client_proof(key: bytes, role: str, hub_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the peer sends in its ``auth``: HMAC(key, "rtop-auth-v1|client|" + role +
    "|" + Ns + "|" + Nc)."""
    return _mac(key, b"client", role, hub_nonce, client_nonce)


def check(expected: bytes, presented: object) -> bool:
    """Constant-time comparison of a proof received with the one expected."""
    return isinstance(presented, bytes) and hmac.compare_digest(expected, presented)
