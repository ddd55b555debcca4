"""Media URLs through every endpoint that fetches them (Chat Completions image and video parts,
its render route, /tokenize, Responses `input_image`, Messages `image` url sources and
/v1/messages/count_tokens): each address of this machine in every spelling, and every other
non-public class, is a 400 naming the part, with zero connections (a loopback listener counts
them; a process-wide guard refuses and records any connect that is not to loopback, so no test
traffic leaves the host); with --allow-private-media-addresses the same request reaches the
listener. Then TLS: the server over HTTPS with the official openai client, and client
certificates (--ssl-cert-reqs 2)."""
import sys
from pathlib import Path

import httpx
import openai
import pytest

from serverutil import MODEL_NAME, InProcessServer, LiveServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))
from media_samples import mp4_bytes, png_bytes  # noqa: E402
from netguard import CountingListener, NetGuard, self_signed  # noqa: E402
from test_media_security import NAMES, loopback_urls, private_urls  # noqa: E402

IMAGE = png_bytes(64, 48, seed=3)


def _video() -> bytes:
    try:
        return mp4_bytes()
    except ImportError:
        return b""


@pytest.fixture(scope="module")
def listener():
    srv = CountingListener({"/a.png": ("image/png", IMAGE), "/v.mp4": ("video/mp4", _video())})
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def closed_server(tiny_vision_dir):
    srv = InProcessServer(tiny_vision_dir)
    srv.client.script = "ok"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def open_server(tiny_vision_dir):
    srv = InProcessServer(tiny_vision_dir, allow_private_media_addresses=True)
    srv.client.script = "ok"
    yield srv
    srv.stop()


@pytest.fixture
def guard(monkeypatch):
    g = NetGuard().install(monkeypatch)
    g.names.update(NAMES)
    return g


def _user(parts):
    return [{"role": "user", "content": [{"type": "text", "text": "describe"}, *parts]}]


# endpoint -> (path, body for a URL, where the part is named in the 400)
ENDPOINTS = {
    "chat": ("/v1/chat/completions", lambda u: {"model": MODEL_NAME, "max_tokens": 2, "messages": _user(
        [{"type": "image_url", "image_url": {"url": u}}])}, "messages[0].content[1]"),
    "chat-video": ("/v1/chat/completions", lambda u: {"model": MODEL_NAME, "max_tokens": 2, "messages": _user(
        [{"type": "video_url", "video_url": {"url": u.replace("/a.png", "/v.mp4")}}])}, "messages[0].content[1]"),
    "chat-render": ("/v1/chat/completions/render", lambda u: {"model": MODEL_NAME, "messages": _user(
        [{"type": "image_url", "image_url": {"url": u}}])}, "messages[0].content[1]"),
    "tokenize": ("/tokenize", lambda u: {"model": MODEL_NAME, "messages": _user(
        [{"type": "image_url", "image_url": {"url": u}}])}, "messages[0].content[1]"),
    "responses": ("/v1/responses", lambda u: {"model": MODEL_NAME, "max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "describe"},
                                     {"type": "input_image", "image_url": u}]}]}, "input[0].content[1]"),
    "messages": ("/v1/messages", lambda u: {"model": MODEL_NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "describe"},
                                     {"type": "image", "source": {"type": "url", "url": u}}]}]},
                 "messages.0.content.1"),
    "count-tokens": ("/v1/messages/count_tokens", lambda u: {"model": MODEL_NAME, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "describe"},
                                     {"type": "image", "source": {"type": "url", "url": u}}]}]},
                     "messages.0.content.1"),
}


def _message(r: httpx.Response) -> str:
    error = r.json().get("error") or {}
    return error.get("message", "") if isinstance(error, dict) else str(error)


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_non_public_addresses_are_400_without_a_connection(closed_server, listener, guard, endpoint):
    path, body, where = ENDPOINTS[endpoint]
    urls = loopback_urls(listener.port, listener.has_ipv6) + private_urls(listener.port)
    failures = []
    with httpx.Client(base_url=closed_server.url, timeout=30) as http:
        for url in urls:
            before = listener.count
            r = http.post(path, json=body(url))
            message = _message(r)
            if r.status_code != 400 or where not in message or not (
                    "is not allowed: it does not resolve to a public address" in message
                    or "malformed URL" in message):
                failures.append((url, r.status_code, message[:160]))
            if listener.count != before:
                failures.append((url, "listener was reached"))
    assert not failures, failures
    assert not guard.attempts_to(listener.port) and not guard.non_loopback(), guard.connects


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_opt_in_reaches_the_listener(open_server, listener, guard, endpoint):
    path, body, _ = ENDPOINTS[endpoint]
    if endpoint == "chat-video":
        pytest.importorskip("av")
    urls = [f"http://127.0.0.1:{listener.port}/a.png", f"http://localhost:{listener.port}/a.png"]
    if listener.has_ipv6:
        urls.append(f"http://[::1]:{listener.port}/a.png")
    with httpx.Client(base_url=open_server.url, timeout=60) as http:
        for url in urls:
            before = listener.count
            r = http.post(path, json=body(url))
            assert r.status_code == 200, (url, r.text[:300])
            assert listener.count == before + 1, url
    assert not guard.non_loopback(), guard.connects


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"), "localhost", ip="127.0.0.1")


def test_https_with_the_openai_client(tiny_dir, certificate, tmp_path):
    """`m3serve serve --ssl-keyfile --ssl-certfile`: the official client over HTTPS, trusting
    the test's self-signed certificate; plain HTTP to the same port gets no answer."""
    cert, key = certificate
    srv = LiveServer(tiny_dir, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                     log_path=tmp_path / "tls.log", tls_ca=cert)
    try:
        assert srv.url.startswith("https://")
        with httpx.Client(verify=srv.verify) as http:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", http_client=http, max_retries=0)
            r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3, temperature=0)
            assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{srv.port}/v1/models", timeout=5).raise_for_status()
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(srv.url + "/v1/models", timeout=5)           # the system CAs do not know it
    finally:
        srv.stop()
    assert "Traceback" not in (tmp_path / "tls.log").read_text()


def test_client_certificates_required(tiny_dir, certificate, tmp_path):
    """--ssl-ca-certs with --ssl-cert-reqs 2: a client with a certificate of that CA is served,
    one without a certificate is refused in the handshake."""
    import ssl
    cert, key = certificate
    client_cert, client_key = self_signed(tmp_path, "client.test")
    srv = InProcessServer(tiny_dir, ssl_keyfile=str(key), ssl_certfile=str(cert), ssl_ca_certs=str(client_cert),
                          ssl_cert_reqs=int(ssl.CERT_REQUIRED))
    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        ctx.load_cert_chain(str(client_cert), str(client_key))
        assert httpx.get(srv.url + "/v1/models", verify=ctx, timeout=10).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url + "/v1/models", verify=ssl.create_default_context(cafile=str(cert)), timeout=10)
    finally:
        srv.stop()


@pytest.mark.parametrize("flags,phrase", [
    ({"ssl_keyfile": "KEY"}, "--ssl-keyfile and --ssl-certfile go together"),
    ({"ssl_keyfile": "KEY", "ssl_certfile": "/nonexistent.pem"}, "--ssl-certfile '/nonexistent.pem' is not"),
    ({"ssl_keyfile": "KEY", "ssl_certfile": "CERT", "ssl_cert_reqs": 2}, "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs"),
    ({"ssl_keyfile": "KEY", "ssl_certfile": "CERT", "ssl_cert_reqs": 5}, "--ssl-cert-reqs must be 0"),
    ({"ssl_ca_certs": "CERT"}, "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"),
    ({"ssl_keyfile": "CERT", "ssl_certfile": "CERT"}, "cannot load the TLS certificate and key"),
])
def test_tls_flags_are_checked(certificate, flags, phrase):
    from m3serve.serving.server_args import ServerConfig
    cert, key = certificate
    values = {k: {"KEY": str(key), "CERT": str(cert)}.get(v, v) for k, v in flags.items()}
    with pytest.raises(ValueError, match=phrase):
        ServerConfig(**values)
