"""Sealed text: what the server hands a client to send back unchanged, encrypted and
authenticated (Fernet: AES-128-CBC and HMAC-SHA256) with a key of the accounts database, and
bound to its owner. A client without the key can neither read nor forge one, and one owner's
sealed text does not open for another. `sign` is an HMAC under a key derived from the same one,
for text the client reads but must not change (the Messages API's thinking blocks).

Sealing serves stateless reasoning round trips (Responses `include:
["reasoning.encrypted_content"]` with `store: false`): the reasoning comes back sealed, and the
next turn's input renders it as the model's own. The key is made once per database
(`sealing_keys`), so every server that shares the accounts database opens what another sealed,
restarted or not."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Callable

from cryptography.fernet import Fernet, InvalidToken

from expresslane.server.database import Database
from expresslane.server.errors import invalid
from expresslane.server.migrations import Migration, migrate

MIGRATIONS = [
    Migration(
        1,
        ("CREATE TABLE IF NOT EXISTS sealing_keys (id INTEGER PRIMARY KEY, key TEXT NOT NULL)",),
    )
]


class Sealer:
    def __init__(self, key: bytes):
        self._key = key
        self._fernet = Fernet(key)

    @classmethod
    def of_database(cls, db: Database) -> Sealer:
        """The database's key, made by the first server that asks."""
        migrate(db, "sealing", MIGRATIONS)
        db.execute(
            "INSERT INTO sealing_keys (id, key) VALUES (1, ?) ON CONFLICT DO NOTHING",
            (Fernet.generate_key().decode(),),
        )
        (key,) = db.execute("SELECT key FROM sealing_keys WHERE id = 1").one()
        return cls(key.encode())

    def seal(self, owner: str, text: str) -> str:
        body = json.dumps({"owner": owner, "text": text}, ensure_ascii=False)
        return self._fernet.encrypt(body.encode()).decode()

    def sign(self, owner: str, text: str) -> str:
        """A signature of `text` for `owner` (an HMAC under a key derived from the sealing
        key): text the client may read, but must send back unchanged."""
        key = hashlib.sha256(b"expresslane signatures\0" + self._key).digest()
        mac = hmac.new(key, owner.encode() + b"\0" + text.encode(), hashlib.sha256)
        return base64.b64encode(mac.digest()).decode()

    def verify(self, owner: str, text: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(owner, text), signature)

    def signer(self, owner: str) -> Callable[[str], str]:
        """`sign` for one owner."""
        return lambda text: self.sign(owner, text)

    def sealing(self, owner: str) -> Callable[[str], str]:
        """`seal` for one owner."""
        return lambda text: self.seal(owner, text)

    def open(self, owner: str, token: str, param: str) -> str:
        """The text sealed for `owner`, or a 400 naming `param`."""
        try:
            body = json.loads(self._fernet.decrypt(token.encode()))
        except (InvalidToken, ValueError, UnicodeError):
            body = None
        if not isinstance(body, dict) or body.get("owner") != owner:
            raise invalid(
                f"'{param}' was not sealed by this server for this API key's owner; send "
                "the reasoning item as a response of this server returned it.",
                param=param,
                code="invalid_encrypted_content",
            )
        return body["text"]
