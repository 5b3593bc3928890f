"""The URLs the worker fetches for a caller (the dataset, validation images): http(s) only, and only to public
addresses. The one owner of those rules: the request checks each URL as written (and an address written in it),
the download every address its host resolves to."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


def forbidden_address_reason(address: Address, *, allow_private: bool) -> str | None:
    """Why the worker must not connect to `address`, or None.

    Link-local (cloud metadata), multicast and unspecified addresses are refused even when private
    addresses are allowed for local testing.
    """
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None:
            return forbidden_address_reason(embedded, allow_private=allow_private)
        if address.teredo is not None:
            return "a Teredo tunnel address"
    if address.is_link_local:
        return "link-local (the cloud metadata range)"
    if address.is_multicast:
        return "multicast"
    if address.is_unspecified:
        return "unspecified"
    if allow_private:
        return None
    if address.is_loopback:
        return "loopback"
    if address.is_private:
        return "private"
    if address.is_reserved:
        return "reserved"
    if not address.is_global:
        return "not publicly routable"
    return None


def literal_address_reason(url: str, *, allow_private: bool) -> str | None:
    """Why the worker must not connect to the IP address written as `url`'s host ("a link-local (…) address"), or
    None: for a host name, only its resolved addresses say (the download checks each)."""
    try:
        address = ipaddress.ip_address((urlsplit(url).hostname or "").split("%", 1)[0])
    except ValueError:
        return None
    reason = forbidden_address_reason(address, allow_private=allow_private)
    return None if reason is None else f"{address}, a {reason} address"


def http_url_problem(value: str) -> str | None:
    """Why `value` is not a URL the worker may download (http or https, a host, no credentials), or None."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        return "is not a valid URL"
    if parts.scheme.lower() not in {"http", "https"}:
        return "only http:// and https:// URLs are accepted"
    if not parts.hostname:
        return "has no host name"
    if parts.username is not None or parts.password is not None:
        return "must not carry credentials (user:password@); use a presigned URL instead"
    if _CONTROL_CHARACTERS.search(value) or " " in value:
        return "contains spaces or control characters; percent-encode them"
    return None
