"""Control-plane auth and secret hygiene, shared by every service and client.

The API token comes from the environment only (secrets never live in the run's YAML):
``STREAMRL_API_TOKEN`` holds it, or ``STREAMRL_API_TOKEN_FILE`` names a file holding it (a
Kubernetes or compose secret); setting both is an error. With a token set:

* control routes (generator ``/admin/*``, trainer ``/pause``, ``/resume``, ``/validate``,
  ``/validations/*``, ``/status``, the gateway's session API for external agents ``POST /sessions``
  and ``POST /sessions/<id>/complete``) require ``Authorization: Bearer <token>``; a missing or
  malformed header is a 401 with ``WWW-Authenticate: Bearer``, a wrong token a 403. Tokens are
  compared with `hmac.compare_digest` (constant time).
* agent routes (generator ``/v1/*`` and ``/tokenize``, the gateway's session routes ``/sessions/*``
  and ``/ng-rollout/*``) stay open
  unless ``auth.protect_agent_routes`` is set; OpenAI clients send their ``api_key`` as that
  bearer token, so agents pass it as their API key.
* ``/health``, ``/ready`` and ``/metrics`` stay open (probes and Prometheus scrapes).

Without a token every route is open, which is only allowed on a loopback bind address: a service
configured to bind anything else refuses to start (`check_bind`) unless ``auth.allow_open_bind``
says the network is private. Neither the token nor Redis credentials are ever logged or shown:
`redact_url` masks the password of a URL, and errors never echo a presented token.

This module imports no web framework (service entry points load it before anything heavy); the
FastAPI dependencies that enforce the policy live in `shared.http`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from shared.config_error import ConfigError

TOKEN_ENV = "STREAMRL_API_TOKEN"
TOKEN_FILE_ENV = "STREAMRL_API_TOKEN_FILE"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_URL_CREDENTIALS = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)([^/@\s:]*):([^/@\s]*)@")


def load_api_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The API token from STREAMRL_API_TOKEN or the file STREAMRL_API_TOKEN_FILE names; None if
    neither is set. Raises ConfigError naming the variable when it cannot be used."""
    env = os.environ if environ is None else environ
    direct, path = env.get(TOKEN_ENV, ""), env.get(TOKEN_FILE_ENV, "")
    if direct and path:
        raise ConfigError(f"set only one of {TOKEN_ENV} and {TOKEN_FILE_ENV}")
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{TOKEN_FILE_ENV}: cannot read {path!r}: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"{TOKEN_FILE_ENV}: {path!r} is empty")
        return _checked(token, TOKEN_FILE_ENV)
    return _checked(direct.strip(), TOKEN_ENV) if direct.strip() else None


def _checked(token: str, source: str) -> str:
    if any(c.isspace() for c in token) or not token.isprintable():
        raise ConfigError(f"{source}: the token must be one printable word without spaces")
    return token


def client_headers(token: str | None) -> dict[str, str]:
    """Headers a client sends to a streamrl service: the bearer token when one is set."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def check_bind(host: str, field: str, token: str | None, allow_open_bind: bool) -> None:
    """Refuse an unauthenticated control plane on a non-loopback address (ConfigError naming
    ``field``), unless ``auth.allow_open_bind`` declares the network private."""
    if token or allow_open_bind or is_loopback(host):
        return
    raise ConfigError(
        f"{field} is {host!r} but no API token is set: set {TOKEN_ENV} or {TOKEN_FILE_ENV}, bind 127.0.0.1, "
        "or set auth.allow_open_bind=true on a private network"
    )


@dataclass(frozen=True)
class AuthPolicy:
    """What a service's routes require; kept on ``app.state.auth``."""

    token: str | None
    protect_agent_routes: bool = False

    def __repr__(self) -> str:  # never print the token
        return f"AuthPolicy(token={'set' if self.token else None}, protect_agent_routes={self.protect_agent_routes})"

    @classmethod
    def from_env(cls, protect_agent_routes: bool = False) -> AuthPolicy:
        return cls(load_api_token(), protect_agent_routes)


def redact_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0``; other URLs unchanged.
    Query parameters that carry secrets (``password=``) are masked too."""
    if not url or "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        creds, host = netloc.rsplit("@", 1)
        user, sep, _ = creds.partition(":")
        if sep:  # a bare "name@" is a user name, not a secret
            netloc = f"{user}:***@{host}"
    query = re.sub(r"(?i)((?:^|&)password=)[^&]*", r"\1***", parts.query)
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing to mask (and unix:///path keeps its form)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Mask ``user:password@`` in every URL inside free text (log lines, error messages)."""
    return _URL_CREDENTIALS.sub(lambda m: f"{m.group(1)}{m.group(2)}:***@", text)
