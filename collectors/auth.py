"""Tokens, roles and the challenge-response that proves them, without sending a secret.

A hub has one **master token** (what ``rtop serve`` makes and its discovery file holds;
``RTOP_TOKEN``). Three **role tokens** are derived from it, one per role::

    stretched = scrypt(master, salt="rtop-role-v2", n=2**14, r=8, p=1)   # ~80 ms, 16 MB
    role_token(master, role) = "rtop-<role>-" + urlsafe-b64(HMAC-SHA256(stretched,
                                                 "rtop-role-v2:" + role))[:32]

* ``ingest``: ranks (``collectors``), which stream records to the hub;
* ``view``: viewers (``rtop``, ``rtop status``) and Prometheus (``/metrics``);
* ``control``: whoever acts on the job (profiling, stacks, link probes).

The master token yields the key of every role; a role token only its own
(:func:`key_for`), so the view token given to Prometheus can never act on a job.

**The handshake (version 2).** Neither side ever sends a token, and **the peer proves
first**: a peer connects and says ``hello`` with its ``role``, ``"auth": 2`` and a fresh
random ``nonce`` Nc; the hub answers ``challenge`` with its own nonce Ns and nothing
else; the peer answers ``auth`` with :func:`client_proof`; only a right proof gets the
``welcome``, which carries :func:`hub_proof`, and the peer checks that before it sends
anything more (so it talks only to a hub that holds the token). Each proof is an
HMAC-SHA256 over both nonces, keyed by the role's key and labelled with the side that
makes it, so neither can be replayed or reflected.

**What an offline guesser gets.** Whoever merely connects gets a nonce: no proof, so
nothing to test guesses against. Whoever poses as the hub (listens on its address
before it does) gets a peer's proof, which is tied to the role's key; that key comes
from a role token of 192 random-looking bits, or from the master through scrypt, so
each guess at a master token costs ~80 ms and 16 MB instead of a microsecond. A token
the user chooses must also be strong enough (:func:`token_weakness`) for a hub that
listens beyond loopback; tokens rtop makes are 192 random bits.

Standard library only: this runs inside training processes.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import itertools
import math
import re
import secrets
from typing import Final

#: The roles a token can grant.
ROLES: Final = ("ingest", "view", "control")
#: The key role each ``hello`` role authenticates with.
#: A relay (``rtop relay``: a node's ranks over one connection) holds the ingest token.
HELLO_ROLES: Final = {"rank": "ingest", "viewer": "view", "control": "control",
                      "relay": "ingest"}
#: The handshake this module speaks (a hello says it as ``"auth"``).
VERSION: Final = 2
#: Bytes of a fresh nonce; a peer's nonce must have at least this many.
NONCE_BYTES: Final = 16
#: The most bytes of a nonce that is accepted.
MAX_NONCE_BYTES: Final = 64
#: Characters of a role token after its ``rtop-<role>-`` prefix.
ROLE_TOKEN_CHARS: Final = 32
#: scrypt's cost for stretching a master token (n, r, p): ~80 ms and 16 MB a guess.
SCRYPT_N: Final = 1 << 14
SCRYPT_R: Final = 8
SCRYPT_P: Final = 1
#: The least estimated strength (bits, :func:`token_bits`) of a token a user chooses
#: for a hub that listens beyond loopback.
MIN_TOKEN_BITS: Final = 80
#: A run of letters counts as one word of a dictionary of 100,000 at most (17 bits).
WORD_BITS: Final = math.log2(100_000)

_LABEL: Final = b"rtop-auth-v2|"
_ROLE_DERIVE: Final = "rtop-role-v2:"
_ROLE_SALT: Final = b"rtop-role-v2"
_KEY_DERIVE: Final = b"rtop-key-v1|"


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (expected one of {', '.join(ROLES)})")


@functools.lru_cache(maxsize=16)
def _stretch(master: str) -> bytes:
    """The master token through scrypt (once per token and process: cached)."""
    return hashlib.scrypt(master.encode(), salt=_ROLE_SALT, n=SCRYPT_N, r=SCRYPT_R,
                          p=SCRYPT_P, maxmem=64 << 20, dklen=32)


def role_token(master: str, role: str) -> str:
    """The token of ``role`` derived from the ``master`` token (see the module doc)."""
    _check_role(role)
    mac = hmac.new(_stretch(master), (_ROLE_DERIVE + role).encode(),
                   hashlib.sha256).digest()
    return f"rtop-{role}-" + base64.urlsafe_b64encode(mac).decode()[:ROLE_TOKEN_CHARS]


_PIECES: Final = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+|[^A-Za-z0-9]")


def token_bits(token: str) -> float:
    """An estimate of how many guesses (log2) a token of the user's costs a guesser who
    tries words and patterns, not characters at random.

    The token is cut into words (letters, a capital starting a new one), runs of digits
    and other characters. A word counts ``len * log2(26)`` bits, plus one if
    capitalised, but at most :data:`WORD_BITS` + 1 (it may be in a dictionary); digits
    ``log2(10)`` each (a run such as ``0123456789`` as one choice, a year as 7 bits);
    any other character 5 bits. A character repeated counts once,
    plus ``log2`` of the repeats; a word of three characters or more said again counts
    only as a choice among those before it. A passphrase of common words counts for more than it
    is worth, a random string for less: it is a floor to refuse the weakest, not a
    measure of the strongest. The tokens rtop makes (``secrets.token_urlsafe(24)``) are
    never judged by it; ``secrets.token_urlsafe(32)``, which the refusal suggests,
    estimates at 120 bits or more.
    """
    bits = 0.0
    seen: set[str] = set()
    for piece in _PIECES.findall(token):
        if len(piece) >= 3 and piece.lower() in seen:
            bits += math.log2(len(seen) + 1)  # a word said again: which of those before
            continue
        seen.add(piece.lower())
        squeezed = re.sub(r"(.)\1+", lambda m: m.group(1), piece)
        repeats = math.log2(len(piece) / len(squeezed)) if len(piece) > len(squeezed) else 0
        if piece[-1].isalpha():
            letters = len(squeezed) * math.log2(26) + (1.0 if piece[0].isupper() else 0.0)
            bits += min(letters, WORD_BITS + 1.0) + repeats
        elif piece.isdigit():
            steps = {int(b) - int(a) for a, b in itertools.pairwise(piece)}
            if len(piece) >= 3 and steps in ({1}, {-1}):  # 0123456789, 987: a run
                bits += math.log2(10) + math.log2(len(piece))
            elif len(piece) == 4 and piece[:2] in ("19", "20"):  # a year
                bits += 7.0
            else:
                bits += len(squeezed) * math.log2(10) + repeats
        else:
            bits += 5.0 + repeats
    return bits


def token_weakness(token: str) -> str | None:
    """Why a token the user chose is too weak for a hub beyond loopback, or None.

    Below :data:`MIN_TOKEN_BITS` by :func:`token_bits`: words, names and dates are
    what guessers try first.
    """
    bits = token_bits(token)
    if bits >= MIN_TOKEN_BITS:
        return None
    return (f"the token is too weak for a hub that listens beyond loopback: about "
            f"{bits:.0f} bits by rtop's estimate (words, digits and symbols counted as a "
            f"guesser tries them), at least {MIN_TOKEN_BITS} needed. Give no token and "
            f"rtop makes one, or make one with: python3 -c \"import secrets; "
            f"print(secrets.token_urlsafe(32))\"")


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
    """What the hub sends in its ``welcome``, once the peer has proved itself:
    HMAC(key, "rtop-auth-v2|hub|" + role + "|" + Nc + "|" + Ns). ``role`` is the
    hello's (``rank``, ``viewer``, ``control``)."""
    return _mac(key, b"hub", role, client_nonce, hub_nonce)


def client_proof(key: bytes, role: str, hub_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the peer sends in its ``auth``, first: HMAC(key, "rtop-auth-v2|client|" +
    role + "|" + Ns + "|" + Nc)."""
    return _mac(key, b"client", role, hub_nonce, client_nonce)


def check(expected: bytes, presented: object) -> bool:
    """Constant-time comparison of a proof received with the one expected."""
    return isinstance(presented, bytes) and hmac.compare_digest(expected, presented)
