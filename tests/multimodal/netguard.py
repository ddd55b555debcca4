"""Network helpers of the media-fetch and TLS tests: a guard that keeps this process off every
network but loopback (connects elsewhere are recorded and refused before any packet; name
lookups other than `localhost` and literals are answered from a table, never from DNS), a
loopback HTTP listener that counts the connections it accepts, and self-signed certificates."""
import http.server
import ipaddress
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex
_real_getaddrinfo = socket.getaddrinfo


def _is_loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%")[0])
        return True
    except ValueError:
        pass
    try:
        socket.inet_aton(host)             # numeric IPv4 spellings: parsed locally, no lookup
        return True
    except OSError:
        return False


class NetGuard:
    """Installed with `install(monkeypatch)`. `connects`: every (address, port) a socket of
    this process tried to connect to, loopback or not; only loopback ones go through.
    `names[name]`: a list of answers (each a list of IP strings, or None for "no such name"),
    one per lookup, the last repeated; `lookups[name]`: how many times it was looked up."""

    def __init__(self):
        self.connects: list[tuple[str, int]] = []
        self.names: dict[str, list] = {}
        self.lookups: dict[str, int] = {}

    def install(self, monkeypatch) -> "NetGuard":
        guard = self

        def connect(sock, address):
            guard._check(address)
            return _real_connect(sock, address)

        def connect_ex(sock, address):
            guard._check(address)
            return _real_connect_ex(sock, address)

        monkeypatch.setattr(socket.socket, "connect", connect)
        monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
        monkeypatch.setattr(socket, "getaddrinfo", self.getaddrinfo)
        return self

    def _check(self, address) -> None:
        if not isinstance(address, tuple):          # unix sockets: not networking
            return
        host, port = address[0], address[1]
        self.connects.append((host, port))
        if not _is_loopback(host):
            raise ConnectionRefusedError(f"test guard: no connection to non-loopback {host}")

    def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):
        name = host.decode() if isinstance(host, bytes) else host
        if name is None or _is_literal(name) or name.lower() == "localhost":
            return _real_getaddrinfo(host, port, family, type, proto, flags)
        key = name.lower()
        self.lookups[key] = self.lookups.get(key, 0) + 1
        answers = self.names.get(key)
        if not answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        answer = answers[min(self.lookups[key], len(answers)) - 1]
        if answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        out = []
        for ip in answer:
            if ":" in ip:
                out.append((socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, port, 0, 0)))
            else:
                out.append((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, port)))
        return out

    def attempts_to(self, port: int) -> list[tuple[str, int]]:
        return [c for c in self.connects if c[1] == port]

    def non_loopback(self) -> list[tuple[str, int]]:
        return [c for c in self.connects if not _is_loopback(c[0])]


class CountingListener:
    """HTTP on 127.0.0.1 (and [::1] when the host has IPv6) at one port, counting accepted
    connections; answers `routes[path]` = (content type, body), else 404."""

    def __init__(self, routes: dict[str, tuple[str, bytes]]):
        self.count = 0
        self._lock = threading.Lock()
        listener = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                listener.hosts.append(self.headers.get("Host"))
                ctype, body = routes.get(self.path, (None, None))
                if body is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def verify_request(self, request, client_address):
                with listener._lock:
                    listener.count += 1
                return True

        self.hosts: list[str] = []
        self.servers = [Server(("127.0.0.1", 0), Handler)]
        self.port = self.servers[0].server_address[1]
        try:
            class Server6(Server):
                address_family = socket.AF_INET6
            self.servers.append(Server6(("::1", self.port), Handler))
            self.has_ipv6 = True
        except OSError:
            self.has_ipv6 = False
        for s in self.servers:
            threading.Thread(target=s.serve_forever, daemon=True).start()

    def close(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()


def self_signed(directory: Path, name: str, ip: str | None = None) -> tuple[Path, Path]:
    """(certificate, key) PEM files for DNS name `name` (and `ip`), self-signed so that the
    certificate is its own CA; made with the openssl command (skips the test without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    alt = f"DNS:{name}" + (f",IP:{ip}" if ip else "")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "2", "-subj", f"/CN={name}", "-addext", f"subjectAltName={alt}",
                    "-addext", "basicConstraints=critical,CA:TRUE"], check=True, capture_output=True)
    return cert, key
