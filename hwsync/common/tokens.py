"""Server-mode tokens: how strong one must be, how to make one (``hwsync token``).

The token is the only secret of server mode: whoever holds it may sync any weights into the engine. It is never sent,
and each side proves knowledge of a scrypt-stretched key (:mod:`hwsync.common.protocol`), but a short or guessable
token would still fall to a patient offline guesser; :func:`check_token` refuses those at ``serve()`` / ``connect()``.
"""

from __future__ import annotations

import secrets
from typing import Any

from hwsync.common.errors import SyncError

__all__ = ["MAKE_TOKEN", "MIN_TOKEN_CHARS", "check_token", "new_token"]

MIN_TOKEN_CHARS = 32
"""``secrets.token_urlsafe(32)`` gives 43 characters (256 bits); ``token_hex(16)`` 32 (128 bits)."""
_MIN_SYMBOLS = 8  # refuses "aaaa..."-like tokens; a random 32-character hex token has fewer than 8 in < 1e-6 cases
MAKE_TOKEN = '`hwsync token` or `python -c "import secrets; print(secrets.token_urlsafe(32))"`'


def new_token() -> str:
    """A fresh random token (256 bits) for :func:`hwsync.serve` and :func:`hwsync.connect`."""
    return secrets.token_urlsafe(32)


def _utf8(token: str) -> bool:
    try:
        token.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_token(token: Any) -> str:
    """``token`` if it is strong enough to guard an engine; otherwise one error saying how to make one (the token
    itself never appears in it)."""
    if not isinstance(token, str):
        weakness = f"a {type(token).__name__}, not a string"
    elif len(token) < MIN_TOKEN_CHARS:
        weakness = f"{len(token)} characters" if token else "empty"
    elif len(set(token)) < _MIN_SYMBOLS:
        weakness = f"only {len(set(token))} distinct characters"
    elif not _utf8(token):
        weakness = "not valid Unicode text: it holds a lone surrogate character, which has no UTF-8 encoding"
    else:
        return token
    # Limitation L7 (docs/limitations.md): strength is judged by length and variety only
    raise SyncError(
        f"the server-mode token is too weak ({weakness}): use a random secret of at least "
        f"{MIN_TOKEN_CHARS} characters, e.g. from {MAKE_TOKEN}, the same one for serve() and connect() "
        "(HWSYNC_TOKEN with ms-swift), passed through the environment or a file, not a command line"
    )
