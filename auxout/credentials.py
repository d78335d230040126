"""Store credentials: kept out of manifests, logs and error messages; supplied by the caller.

A route manifest travels to any HTTP client and vLLM logs its whole configuration at startup, so
neither may carry a store's user or password. Addresses (``RedisStore.address``, a manifest's
``store``) are always written without them (:func:`split_credentials`), and every message that
shows a URL or an option dict goes through :func:`redact`.

The side that opens a store supplies the credentials (:func:`resolve_credentials`), first found:

1. ``username=`` / ``password=`` passed by the caller (``auxout.fetch(manifest, password=...)``);
2. credentials written in the URL the caller gave (a store option ``url``);
3. a URL naming the same server (scheme family, host and port; a socket path for ``unix://``)
   with its credentials, in ``AUXOUT_STORE_URL`` (several may be given, separated by spaces)
   or in ``REDIS_URL`` (the variable redis-py applications conventionally read);
4. ``AUXOUT_STORE_PASSWORD`` (and ``AUXOUT_STORE_USERNAME``), for any store without its own.

``auxout.vllm.engine_kwargs`` moves a URL's credentials out of the options it hands to vLLM
into ``AUXOUT_STORE_URL`` of its own process, which vLLM's engine and worker processes inherit
(:func:`export_store_url`).
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

PASSWORD_ENV = "AUXOUT_STORE_PASSWORD"
USERNAME_ENV = "AUXOUT_STORE_USERNAME"
STORE_URL_ENV = "AUXOUT_STORE_URL"
REDIS_URL_ENV = "REDIS_URL"
_SECRET_QUERY = ("password", "username")  # redis-py reads both from a URL's query too
_DEFAULT_PORTS = {"redis": 6379, "rediss": 6379}


def split_credentials(url: str) -> tuple[str, str | None, str | None]:
    """``(url without user and password, user, password)``; user info and the query parameters
    ``username``/``password`` are both removed (redis-py accepts either)."""
    parts = urlsplit(url)
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    netloc = parts.netloc.rpartition("@")[2]
    query = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key == "password":
            password = password or value or None
        elif key == "username":
            username = username or value or None
        else:
            query.append((key, value))
    # (by hand: urlunsplit drops the "//" of an empty authority, which unix:// URLs have)
    clean = f"{parts.scheme}://{netloc}{parts.path}" + (f"?{urlencode(query)}" if query else "")
    return clean + (f"#{parts.fragment}" if parts.fragment else ""), username, password


def has_credentials(url: str) -> bool:
    _, username, password = split_credentials(url)
    return username is not None or password is not None


_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^/?#\s'\"]*)@")
_BARE_USERINFO = re.compile(r"(?:^|(?<=[\s'\"(\[{=,]))[^\s'\"/]+@(?=[^\s'\"@/]+)")  # user:pw@host:port
_QUERY_SECRET = re.compile(r"(?P<key>[?&](?:password|username)=)[^&#\s'\"]*")


def redact(value: Any) -> str:
    """``str(value)`` (``repr`` for non-strings) with every URL's user info (also a bare
    ``user:secret@host:port``) and ``password=`` / ``username=`` query values replaced by ``***``:
    safe to put in a log line or an error."""
    text = value if isinstance(value, str) else repr(value)
    text = _USERINFO.sub(lambda m: f"{m['scheme']}***@", text)
    text = _BARE_USERINFO.sub("***@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['key']}***", text)


def same_server(a: str, b: str) -> bool:
    """Whether two store URLs name the same server: host and port (scheme ``redis``/``rediss``),
    or socket path (``unix``). The database and other options may differ."""
    pa, pb = urlsplit(a), urlsplit(b)
    if (pa.scheme == "unix") != (pb.scheme == "unix"):
        return False
    if pa.scheme == "unix":
        return bool(pa.path) and unquote(pa.path) == unquote(pb.path)
    try:
        port_a = pa.port or _DEFAULT_PORTS.get(pa.scheme)
        port_b = pb.port or _DEFAULT_PORTS.get(pb.scheme)
    except ValueError:  # (a malformed port: not the same server)
        return False
    host_a, host_b = (pa.hostname or "").lower(), (pb.hostname or "").lower()
    return bool(host_a) and host_a == host_b and port_a == port_b


def _env_urls() -> list[str]:
    urls = os.environ.get(STORE_URL_ENV, "").split()
    redis_url = os.environ.get(REDIS_URL_ENV, "").strip()
    return urls + ([redis_url] if redis_url else [])


def resolve_credentials(
    url: str, *, username: str | None = None, password: str | None = None
) -> tuple[str, str | None, str | None]:
    """``(url without credentials, user, password)`` to open the store at ``url`` with; see the
    module docstring for where each comes from."""
    clean, own_user, own_password = split_credentials(url)
    if username is not None or password is not None:
        return clean, username, password
    if own_user is not None or own_password is not None:
        return clean, own_user, own_password
    for candidate in _env_urls():
        if same_server(clean, candidate):
            _, env_user, env_password = split_credentials(candidate)
            if env_user is not None or env_password is not None:
                return clean, env_user, env_password
    return clean, os.environ.get(USERNAME_ENV) or None, os.environ.get(PASSWORD_ENV) or None


def export_store_url(url: str) -> None:
    """Add ``url`` (with its credentials) to ``AUXOUT_STORE_URL`` of this process, for the
    processes it starts (vLLM's engine core and workers). A URL naming the same server with
    other credentials already there is an error (the message shows neither)."""
    present = os.environ.get(STORE_URL_ENV, "").split()
    _, user, password = split_credentials(url)
    for other in present:
        if same_server(url, other):
            if split_credentials(other)[1:] != (user, password):
                raise ValueError(
                    f"the store URL {redact(url)} carries credentials, and {STORE_URL_ENV} names the same "
                    "server with other ones: give them once"
                )
            return
    os.environ[STORE_URL_ENV] = " ".join([*present, url])
