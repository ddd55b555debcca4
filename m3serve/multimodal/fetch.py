"""Fetching an http(s) media URL for a client without letting it reach the server's own network.

The host is resolved once, every address it resolves to must be public (not loopback, private,
link-local, shared, unspecified, multicast, broadcast, reserved, nor an IPv6 form embedding such
an IPv4 address) unless the operator opted in, and the connection goes to an address that was
checked: no second resolution, so DNS rebinding cannot switch it. Host header, TLS SNI and
certificate checks keep the URL's hostname. Redirects are never followed; proxies are not used.
"""
from __future__ import annotations

import ipaddress
import socket

# One message for every refusal (and for a name that does not resolve), so that the answer
# says nothing about what the address is or whether an internal name exists.
NOT_ALLOWED = ("the URL's host is not allowed: it does not resolve to a public address (the server "
               "fetches media from public addresses only unless started with --allow-private-media-addresses)")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# IPv6 prefixes that embed an IPv4 address in their low 32 bits (NAT64 well-known and local-use)
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))
_SHARED = ipaddress.IPv4Network("100.64.0.0/10")


def is_public(ip: IPAddress) -> bool:
    """Whether an address is a public unicast one, judging IPv6 forms that carry an IPv4 address
    (mapped `::ffff:a.b.c.d`, compatible `::a.b.c.d`, NAT64, 6to4, Teredo) by that address."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public(ip.ipv4_mapped)
        if int(ip) >> 32 == 0:                      # IPv4-compatible (also :: and ::1)
            return False
        if any(ip in net for net in _NAT64):
            return is_public(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.sixtofour is not None and not is_public(ip.sixtofour):
            return False
        if ip.teredo is not None and not all(is_public(v4) for v4 in ip.teredo):
            return False
        if ip.is_site_local or ip.scope_id:
            return False
    elif ip in _SHARED or ip == ipaddress.IPv4Address("255.255.255.255"):
        return False
    return ip.is_global and not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                                 or ip.is_reserved or ip.is_unspecified)


def is_noncanonical_ipv4(host: str) -> bool:
    """Whether a host is a numeric IPv4 address in a form other than the dotted quad (decimal
    `2130706433`, hex `0x7f000001`, octal `0177.0.0.1`, short `127.1`, `0`): resolvers accept
    these, and they exist to slip past string checks."""
    try:
        packed = socket.inet_aton(host)
    except (OSError, ValueError):
        return False
    return host != socket.inet_ntoa(packed)


def resolve(host: str, port: int) -> list[IPAddress]:
    """The addresses `host` resolves to (a literal resolves to itself), through
    `socket.getaddrinfo`; ValueError(NOT_ALLOWED) when it resolves to none."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        raise ValueError(NOT_ALLOWED) from None
    out = []
    for family, *_, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        ip = ipaddress.ip_address(sockaddr[0])             # may carry an IPv6 %scope
        if ip not in out:
            out.append(ip)
    if not out:
        raise ValueError(NOT_ALLOWED)
    return out


def checked_addresses(host: str, port: int, allow_private: bool) -> list[IPAddress]:
    """The addresses the fetch may connect to: all of the host's, each one public unless
    `allow_private`; ValueError(NOT_ALLOWED) otherwise. A host whose addresses are mixed is
    refused as a whole."""
    if not allow_private and is_noncanonical_ipv4(host):
        raise ValueError(NOT_ALLOWED)
    addresses = resolve(host, port)
    if not allow_private and not all(is_public(ip) for ip in addresses):
        raise ValueError(NOT_ALLOWED)
    return addresses


def connect_tcp(ip: IPAddress, port: int, timeout: float | None):
    """A TCP stream to one checked address (an httpcore network stream)."""
    import httpcore
    return httpcore.SyncBackend().connect_tcp(str(ip), port, timeout=timeout)


def _pinned_backend(url_host: str, addresses: list[IPAddress]):
    import httpcore

    class PinnedBackend(httpcore.NetworkBackend):
        """Connects the URL's host to the checked addresses only, in the resolver's order."""

        def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
            if host != url_host:            # httpcore connects only to the URL's origin
                raise httpcore.ConnectError("unexpected host")
            error = None
            for ip in addresses:
                try:
                    return connect_tcp(ip, port, timeout)
                except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                    error = e
            raise error

        def connect_unix_socket(self, *args, **kwargs):
            raise httpcore.ConnectError("unix sockets are not used")

        def sleep(self, seconds: float) -> None:
            import time
            time.sleep(seconds)

    return PinnedBackend()


def fetch(url: str, modality: str, limit: int, timeout_s: float, allowed_domains: tuple[str, ...] | None,
          allow_private: bool) -> bytes:
    """The body of an http(s) URL: a 200 answer of the part's content type (or
    application/octet-stream) of at most `limit` bytes, from a host of `allowed_domains` (None:
    any) at a public address (any address with `allow_private`). ValueError saying what failed."""
    import httpcore
    import httpx
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"malformed URL ({e})") from None
    host = parsed.host.lower()
    if not host:
        raise ValueError("URL has no host")
    if parsed.userinfo:
        raise ValueError("URLs with credentials (user@host) are not supported")
    if allowed_domains is not None and host not in allowed_domains:
        raise ValueError(f"media host {host!r} is not in --allowed-media-domains")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    raw_host = parsed.raw_host.decode("ascii")
    addresses = checked_addresses(raw_host, port, allow_private)
    target = httpcore.URL(scheme=parsed.raw_scheme, host=parsed.raw_host, port=parsed.port,
                          target=parsed.raw_path)
    netloc = parsed.netloc     # "host[:port]", brackets kept for IPv6
    timeouts = {"connect": timeout_s, "read": timeout_s, "write": timeout_s, "pool": timeout_s}
    try:
        with httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(), retries=0,
                                     network_backend=_pinned_backend(raw_host, addresses)) as pool:
            with pool.stream("GET", target, headers=[(b"Host", netloc), (b"Accept", b"*/*"),
                                                     (b"User-Agent", b"m3serve")],
                             extensions={"timeout": timeouts}) as r:
                if r.status != 200:
                    raise ValueError(f"fetching the URL answered HTTP {r.status}")
                headers = {k.lower(): v.decode("latin-1") for k, v in r.headers}
                ctype = headers.get(b"content-type", "").split(";")[0].strip().lower()
                if ctype and not ctype.startswith(f"{modality}/") and ctype != "application/octet-stream":
                    raise ValueError(f"the URL's content type {ctype!r} is not an {modality} type")
                declared = headers.get(b"content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise ValueError(f"{modality} is larger than {limit} bytes")
                data = bytearray()
                for chunk in r.iter_stream():
                    data += chunk
                    if len(data) > limit:
                        raise ValueError(f"{modality} is larger than {limit} bytes")
                return bytes(data)
    except httpcore.TimeoutException:
        raise ValueError(f"fetching the URL took longer than {timeout_s} s") from None
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol) as e:
        raise ValueError(f"cannot fetch the URL ({type(e).__name__}: {e})") from None
