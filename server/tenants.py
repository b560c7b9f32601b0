"""Tenants: who may use which namespaces, and how a bearer token is recognised.

Owns the tenants file (JSON, tokens stored only as SHA-256 hex), namespace patterns,
roles and the constant-time token check. It knows nothing about gRPC or HTTP: the
interceptor and the admin API ask `Authenticator` and map its errors to statuses.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsplice.common.errors import PermissionDenied, Unauthenticated
from kvsplice.common.segment import validate_namespace

logger = logging.getLogger(__name__)

ROLES = ("reader", "writer", "admin")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_KEYS = ("name", "token_sha256", "namespaces", "role")
TOKEN_NBYTES = 32  # secrets.token_urlsafe(32): 43 characters, 256 bits


def token_sha256(token: str) -> str:
    """The hex digest a tenants file stores for `token`."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_NBYTES)


# NOTE: `*` matches only at a boundary, so `team-a*` never covers `team-admin` or `team-ab`.
# `-` and `_` join words inside one name (`team-a`), so only `.` and `:` separate a name from
# what is derived from it (`team-a.salt-<hex>`, the connector's salted namespaces).
NAMESPACE_SEPARATORS = ".:"
_PATTERN_BOUNDARY = ".:-_"  # a pattern ending in one of these (`team-a-*`) states its own boundary


def pattern_covers(pattern: str, namespace: str) -> bool:
    """Whether namespace entry `pattern` covers `namespace`.

    `*` covers every namespace; `team-a` only itself; `team-a*` covers `team-a` and
    `team-a.<rest>` / `team-a:<rest>`; `team-a-*` (boundary written) covers `team-a-<rest>`.
    """
    if not pattern.endswith("*"):
        return namespace == pattern
    prefix = pattern[:-1]
    if not prefix or prefix[-1] in _PATTERN_BOUNDARY:
        return namespace.startswith(prefix)
    rest = namespace.removeprefix(prefix)
    return namespace.startswith(prefix) and (not rest or rest[0] in NAMESPACE_SEPARATORS)


def _check_pattern(pattern: str) -> str:
    """A namespace, or a namespace prefix followed by `*` (see `pattern_covers`)."""
    if pattern == "*":
        return pattern
    try:
        validate_namespace(pattern[:-1] if pattern.endswith("*") else pattern)
    except ValueError as error:
        raise ValueError(f"namespace pattern {pattern!r}: {error}") from error
    return pattern


@dataclass(frozen=True)
class Tenant:
    """One credential: its namespaces (names or `prefix*` patterns: `pattern_covers`) and its role.

    readers read; writers also put and delete; admins may use every namespace.
    """

    name: str
    token_sha256: str
    namespaces: tuple[str, ...]
    role: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"tenant name {self.name!r} must match {_NAME.pattern}")
        if not isinstance(self.token_sha256, str) or not _SHA256_HEX.fullmatch(self.token_sha256):
            raise ValueError(f"tenant {self.name!r}: token_sha256 must be 64 lowercase hex digits")
        if self.role not in ROLES:
            raise ValueError(f"tenant {self.name!r}: role {self.role!r} is not one of {ROLES}")
        if not self.namespaces and self.role != "admin":
            raise ValueError(f"tenant {self.name!r} names no namespace")
        for pattern in self.namespaces:
            _check_pattern(pattern)

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def can_write(self) -> bool:
        return self.role in ("writer", "admin")

    def may_use(self, namespace: str) -> bool:
        if self.is_admin:
            return True
        return any(pattern_covers(p, namespace) for p in self.namespaces)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "token_sha256": self.token_sha256,
            "namespaces": list(self.namespaces),
            "role": self.role,
        }

    @classmethod
    def from_json(cls, entry: Any) -> Tenant:
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        if keys != sorted(_KEYS):
            # Name the keys only: a misplaced plain token must not reach a log line.
            raise ValueError(f"a tenant entry holds exactly {sorted(_KEYS)}, not {keys}")
        namespaces = entry["namespaces"]
        if not isinstance(namespaces, list) or not all(isinstance(n, str) for n in namespaces):
            raise ValueError(f"tenant {entry['name']!r}: namespaces must be a list of strings")
        return cls(entry["name"], entry["token_sha256"], tuple(namespaces), entry["role"])


@dataclass(frozen=True)
class TenantTable:
    """The tenants of one file: `{"tenants": [{"name", "token_sha256", "namespaces", "role"}]}`."""

    tenants: tuple[Tenant, ...] = ()

    def __post_init__(self) -> None:
        names = [t.name for t in self.tenants]
        digests = [t.token_sha256 for t in self.tenants]
        if len(set(names)) != len(names) or len(set(digests)) != len(digests):
            raise ValueError("tenant names and token hashes must be unique")

    @classmethod
    def parse(cls, text: str) -> TenantTable:
        document = json.loads(text)
        if not isinstance(document, dict) or not isinstance(document.get("tenants"), list):
            raise ValueError('a tenants file is {"tenants": [...]}')
        return cls(tuple(Tenant.from_json(entry) for entry in document["tenants"]))

    @classmethod
    def load(cls, path: Path) -> TenantTable:
        return cls.parse(path.read_text()) if path.exists() else cls()

    def dumps(self) -> str:
        return json.dumps({"tenants": [t.to_json() for t in self.tenants]}, indent=2) + "\n"

    def with_tenant(self, tenant: Tenant) -> TenantTable:
        if any(t.name == tenant.name for t in self.tenants):
            raise ValueError(f"tenant {tenant.name!r} already exists")
        return TenantTable((*self.tenants, tenant))

    def without(self, name: str) -> TenantTable:
        """The table less tenant `name`; ValueError if it has none of that name."""
        self.named(name)
        return TenantTable(tuple(t for t in self.tenants if t.name != name))

    def with_token(self, name: str, token_digest: str) -> TenantTable:
        """The table with tenant `name`'s token hash replaced (its old token stops working)."""
        old = self.named(name)
        new = Tenant(old.name, token_digest, old.namespaces, old.role)
        return TenantTable(tuple(new if t.name == name else t for t in self.tenants))

    def named(self, name: str) -> Tenant:
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        raise ValueError(f"no tenant {name!r}")

    def find(self, token: str) -> Tenant | None:
        """The tenant holding `token`, comparing every hash in constant time (no early exit)."""
        presented = token_sha256(token).encode()
        found = None
        for tenant in self.tenants:
            if hmac.compare_digest(presented, tenant.token_sha256.encode()):
                found = tenant
        return found


OPEN_ACCESS = Tenant("open", "0" * 64, (), "admin")  # what every caller is when auth is off


class Authenticator:
    """Bearer token -> tenant, and the namespace/role check. Thread-safe; `reload()` on SIGHUP.

    With neither a tenants file nor an admin token every caller is `OPEN_ACCESS`.
    `admin_token` (`--auth-token`) is one more admin credential beside the file's.
    """

    def __init__(self, tenants_path: Path | None = None, admin_token: str | None = None) -> None:
        if admin_token is not None and not admin_token.strip():
            raise ValueError("admin_token must be None or a non-blank token")
        self._path = tenants_path
        self._admin = (
            None
            if admin_token is None
            else Tenant("auth-token", token_sha256(admin_token), (), "admin")
        )
        self._lock = threading.Lock()
        self._table = TenantTable.load(tenants_path) if tenants_path is not None else TenantTable()

    @property
    def enabled(self) -> bool:
        return self._path is not None or self._admin is not None

    def reload(self) -> bool:
        """Re-read the tenants file; on a bad file keep the current tenants (and say so)."""
        if self._path is None:
            return False
        try:
            table = TenantTable.load(self._path)
        except (OSError, ValueError) as error:
            logger.error("tenants file %s not reloaded, keeping the old one: %s", self._path, error)
            return False
        with self._lock:
            self._table = table
        logger.info("tenants reloaded from %s: %d tenants", self._path, len(table.tenants))
        return True

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an `authorization: Bearer <token>` value; Unauthenticated if none."""
        if not self.enabled:
            return OPEN_ACCESS
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("missing bearer token")
        with self._lock:
            table = self._table
        tenant = table.find(token)
        if self._admin is not None and hmac.compare_digest(
            token_sha256(token).encode(), self._admin.token_sha256.encode()
        ):
            tenant = self._admin
        if tenant is None:
            raise Unauthenticated("missing or unknown bearer token")
        return tenant

    @staticmethod
    def authorize(tenant: Tenant, namespace: str, *, write: bool = False) -> None:
        """PermissionDenied unless `tenant` may use `namespace` (and write, if asked)."""
        if not tenant.may_use(namespace):
            raise PermissionDenied(f"tenant {tenant.name!r} may not use namespace {namespace!r}")
        if write and not tenant.can_write:
            raise PermissionDenied(f"tenant {tenant.name!r} is a {tenant.role}: it may not write")
