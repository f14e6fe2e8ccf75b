"""The Redis URLs the registry takes, checked without the `redis` extra (the configuration
checks them at start), and their logged form without secrets."""

from __future__ import annotations


def redacted(url: str) -> str:
    """The URL without a password (in its user part or its query), for logs."""
    scheme, sep, rest = url.partition("://")
    rest, qsep, query = rest.partition("?")
    # The user part ends at the authority's last "@" (a password may hold an unescaped "@"),
    # and the authority at the first "/" (a unix socket's path may hold an "@" of its own).
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        rest = "***@" + authority.rpartition("@")[2] + slash + path
    if query:
        query = "&".join(f"{k}=***" if "password" in k else f"{k}={v}"
                         for k, _, v in (p.partition("=") for p in query.split("&")))
    return scheme + sep + rest + qsep + query


SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster",
           "rediss+cluster")
SENTINEL_PORT = 26379


def check_url(url: str) -> None:
    """Raise ValueError, with what a good URL looks like, when `url` is not one `connect`
    takes."""
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in SCHEMES:
        raise ValueError(
            f"redis_url {redacted(url)!r}: the scheme must be one of {', '.join(SCHEMES)}, e.g. "
            "redis://127.0.0.1:6379/0, rediss://redis.example:6380/0?ssl_ca_certs=/ca.pem or "
            "redis+sentinel://s1:26379,s2:26379,s3:26379/mymaster/0 or "
            "redis+cluster://n1:6379,n2:6379,n3:6379")
    if scheme.endswith("+sentinel"):
        sentinel_parts(url)
    if scheme.endswith("+cluster"):
        cluster_parts(url)


def _hosts(url: str, hosts: str, default_port: int, what: str) -> list[tuple[str, int]]:
    """`host[:port][,host[:port]...]` (IPv6 hosts in brackets) as (host, port) pairs."""
    out: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, colon, port = item.rpartition(":") if not item.endswith("]") else (item, "", "")
        if not colon:
            host, port = item, str(default_port)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"redis_url {redacted(url)!r}: bad {what} address {item!r} "
                             "(host[:port], comma-separated)")
        out.append((host, int(port)))
    return out


def cluster_parts(url: str) -> tuple[list[tuple[str, int]], str]:
    """A cluster URL's seed nodes, and the plain URL (user, password, query) its nodes are
    connected with: `[redis|rediss]+cluster://[user:password@]host[:port][,host[:port]...]
    [?query]`. Any node of the cluster will do as a seed; more than one survives one's loss.
    A cluster has no databases: a path is refused."""
    scheme, _, rest = url.partition("://")
    rest, qsep, query = rest.partition("?")
    hosts, _, path = rest.partition("/")
    if path:
        raise ValueError(f"redis_url {redacted(url)!r}: a Redis Cluster has database 0 only; "
                         "drop the path, e.g. redis+cluster://n1:6379,n2:6379")
    auth, at, hosts = hosts.rpartition("@")
    nodes = _hosts(url, hosts, 6379, "cluster node")
    return nodes, f"{scheme.partition('+')[0]}://{auth}{at}seed{qsep}{query}"


def sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, str]:
    """A sentinel URL's sentinels, service name, and the plain URL (user, password, database,
    query) that its primary is connected with: `[redis|rediss]+sentinel://[user:password@]
    host[:port][,host[:port]...]/service[/db][?query]`."""
    scheme, _, rest = url.partition("://")
    rest, qsep, query = rest.partition("?")
    hosts, _, path = rest.partition("/")
    auth, at, hosts = hosts.rpartition("@")
    sentinels = _hosts(url, hosts, SENTINEL_PORT, "sentinel")
    service, _, db = path.partition("/")
    if not service:
        raise ValueError(f"redis_url {redacted(url)!r}: name the Sentinel service after the "
                         "sentinels, e.g. redis+sentinel://s1:26379,s2:26379/mymaster")
    if db and not db.isdigit():
        raise ValueError(f"redis_url {redacted(url)!r}: the database must be a number")
    plain = f"{scheme.partition('+')[0]}://{auth}{at}primary/{db or 0}{qsep}{query}"
    return sentinels, service, plain
