"""Which engine URLs a router accepts: the gateway POSTs every turn to an instance's `http_url`,
so a URL is a request the gateway will make on an engine's word (server-side request forgery,
SSRF, when that word is a lie).

The policy (`--engine-url-allow`, `KVBRIDGE_ROUTER_ENGINE_URL_ALLOW`) is a comma-separated list
of host names (exact, or `*`-patterns such as `*.engines.internal`) and CIDRs (`10.0.0.0/8`,
`fd00::/8`); `*` alone allows any host. An URL is accepted when its host matches a name in the
list (taken as named, not looked up here), or every address its host resolves to (now, at
registration) lies in a listed CIDR.
Empty (the default) means: loopback addresses only when the router itself listens on a loopback
address (a local stack), else any host but loopback ones (the gateway's own host).

Always refused, whatever the list says: link-local addresses (169.254.0.0/16, where clouds serve
instance metadata and credentials, and fe80::/10) and the other metadata addresses
(fd00:ec2::254, 100.100.100.200), unspecified, multicast and broadcast addresses, also inside an
IPv6 address (IPv4-mapped, NAT64, 6to4), hosts that do not resolve, URLs with credentials
(`user@`), a query or a fragment, and hosts or ports that are not plain (no backslashes, no
percent-escapes). The name is
resolved once, here; a name whose DNS answer changes later (rebinding) is only as safe as that
DNS: list CIDRs rather than names where engines' names are not under the operator's control.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvbridge.auth import is_loopback_host
from kvbridge.errors import InvalidArgument

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

LOOPBACK: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"),
                                 ipaddress.ip_network("::1/128"))
_NAME = re.compile(r"[a-z0-9]([a-z0-9_-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9_-]*[a-z0-9])?)*\.?")
_PATTERN = re.compile(r"[a-z0-9*?._-]+")
_NETLOC = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?")
_PATH = re.compile(r"[A-Za-z0-9._~/!$&'()*+,;=:@-]*")
_RESOLVE_TIMEOUT_S = 2.0


# Instance metadata services outside the link-local ranges (AWS over IPv6, Alibaba Cloud).
_METADATA = frozenset({ipaddress.ip_address("fd00:ec2::254"),
                       ipaddress.ip_address("100.100.100.200")})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _plain(address: Address) -> Address:
    """The IPv4 address an IPv6 one carries (IPv4-mapped, NAT64, 6to4), else itself: the
    address a connection to it reaches."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def always_refused(address: Address) -> bool:
    """Addresses no engine URL may name: link-local and other metadata addresses,
    unspecified, multicast, broadcast (also as carried inside an IPv6 address)."""
    plain = _plain(address)
    return any(a.is_link_local or a.is_unspecified or a.is_multicast or a in _METADATA
               or a == ipaddress.IPv4Address("255.255.255.255") for a in (address, plain))


@dataclass(frozen=True)
class EngineUrlPolicy:
    """The hosts an engine URL may name: `any_host`, else names matching `names` or addresses
    inside `networks` (see the module docstring)."""

    any_host: bool
    names: tuple[str, ...] = ()
    networks: tuple[Network, ...] = ()
    loopback: bool = True  # with any_host: whether loopback hosts count (not by default)

    @classmethod
    def parse(cls, allow: str, listen_host: str) -> EngineUrlPolicy:
        """The policy `allow` describes (ValueError naming a bad entry); empty: the default for
        a router listening on `listen_host`."""
        entries = [e.strip().lower() for e in allow.split(",") if e.strip()]
        if not entries:
            if is_loopback_host(listen_host):
                return cls(False, (), LOOPBACK)
            return cls(True, loopback=False)
        names: list[str] = []
        networks: list[Network] = []
        for entry in entries:
            if entry == "*":
                return cls(True)
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            if not _PATTERN.fullmatch(entry):
                raise ValueError(f"engine_url_allow: {entry!r} is neither a CIDR nor a host "
                                 "name pattern")
            names.append(entry)
        return cls(False, tuple(names), tuple(networks))

    def describe(self) -> str:
        if self.any_host:
            return ("any host" + ("" if self.loopback else " but loopback")
                    + " (link-local and metadata addresses refused)")
        return ",".join([*self.names, *(str(n) for n in self.networks)])

    async def check(self, url: str) -> None:
        """InvalidArgument (field http_url) unless `url` is a plain http(s) URL this policy
        allows."""
        if not url.isascii() or not url.isprintable():
            raise InvalidArgument("http_url", "must be printable ASCII")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as err:
            raise InvalidArgument("http_url", f"not a valid URL: {err}") from None
        if parts.scheme not in ("http", "https"):
            raise InvalidArgument("http_url", "must be an http:// or https:// URL")
        if (not _NETLOC.fullmatch(parts.netloc) or parts.query or parts.fragment
                or "?" in url or "#" in url or not _PATH.fullmatch(parts.path)):
            raise InvalidArgument("http_url", "must be scheme://host[:port][/path], without "
                                  "credentials, query, fragment or escapes")
        if port is not None and not 0 < port < 65536:
            raise InvalidArgument("http_url", "port out of range")
        host = (parts.hostname or "").lower()
        literal: Address | None
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is None and not _NAME.fullmatch(host):
            raise InvalidArgument("http_url", f"bad host name {host[:64]!r}")
        if literal is None and not self.any_host and any(
                fnmatch.fnmatchcase(host.rstrip("."), p) for p in self.names):
            # A name the operator listed is trusted as named: not looked up here (the router's
            # DNS view may differ from the gateway's, or lag a new pod's record); the gateway
            # still refuses metadata addresses whenever it resolves the name.
            return
        addresses = [literal] if literal is not None else await _resolve(host, port or 80)
        for address in addresses:
            if always_refused(address):
                raise InvalidArgument("http_url", f"host {host[:64]} is (or resolves to) "
                                      f"{address}: link-local, metadata, unspecified or "
                                      "multicast addresses are never engines")
        if self.any_host:
            # By default a router reached beyond loopback never sends turns to its own host's
            # services (a loopback engine there is listed: --engine-url-allow 127.0.0.0/8).
            if not self.loopback and any(_plain(a).is_loopback for a in addresses):
                raise InvalidArgument("http_url", f"host {host[:64]} is (or resolves to) a "
                                      "loopback address, which this router's policy (any host "
                                      "but loopback) refuses; list it in --engine-url-allow")
            return
        if all(any(_plain(a) in n for n in self.networks) for a in addresses):
            return
        raise InvalidArgument("http_url", f"host {host[:64]} is not allowed by the router's "
                              f"engine URL policy ({self.describe()}; see --engine-url-allow)")


async def _resolve(host: str, port: int) -> list[Address]:
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), _RESOLVE_TIMEOUT_S)
    except (OSError, TimeoutError) as err:
        raise InvalidArgument("http_url", f"host {host[:64]} does not resolve "
                              f"({type(err).__name__})") from None
    out: list[Address] = []
    for family, *_rest, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            out.append(ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]))
    if not out:
        raise InvalidArgument("http_url", f"host {host[:64]} has no IP address")
    return out
