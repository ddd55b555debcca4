"""The media fetcher keeps requests off the server's own network, and decoding stays bounded:
every non-public address class in every spelling is refused before any connection (checked by a
guard that lets this process reach loopback only, and by a loopback listener that counts
connections); the opt-in reaches the listener; the address checked is the one connected to
(a resolver that changes its answer is asked once); https keeps the URL's hostname for SNI and
certificate checks; image and video bombs are refused with small peak memory (in a subprocess)."""
import ipaddress
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from m3serve.multimodal.fetch import NOT_ALLOWED, is_public
from m3serve.multimodal.media import MediaPolicy, decode_video, load_bytes
from m3serve.multimodal.parts import check_upscale
from m3serve.multimodal.processor import ProcessorOptions
from media_samples import png_bytes
from netguard import CountingListener, NetGuard, self_signed

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGE = png_bytes(32, 24)

NON_PUBLIC = [
    "127.0.0.1", "127.255.255.254", "10.0.0.1", "172.16.0.1", "172.31.255.255", "192.168.1.1",
    "169.254.169.254", "100.64.0.1", "100.127.255.254", "0.0.0.0", "0.1.2.3", "224.0.0.1",
    "239.255.255.250", "255.255.255.255", "240.0.0.1", "192.0.0.1", "192.0.2.1", "198.18.0.1",
    "198.51.100.1", "203.0.113.1",
    "::1", "::", "fe80::1", "fc00::1", "fd12:3456::1", "ff02::1", "ff0e::1", "fec0::1", "2001:db8::1",
    "100::1", "2001::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1",
    "::169.254.169.254", "::a00:1", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "64:ff9b:1::a00:1",
    "2002:7f00:1::", "2002:a9fe:a9fe::", "2001:0:4136:e378:8000:63bf:3fff:fdd2",
]
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.215.14", "2606:4700:4700::1111", "2a00:1450:4001::200e",
          "::ffff:8.8.8.8", "64:ff9b::808:808"]


@pytest.mark.parametrize("address", NON_PUBLIC)
def test_non_public_addresses(address):
    assert not is_public(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses(address):
    assert is_public(ipaddress.ip_address(address))


@pytest.fixture
def guard(monkeypatch):
    return NetGuard().install(monkeypatch)


@pytest.fixture(scope="module")
def listener():
    srv = CountingListener({"/a.png": ("image/png", IMAGE)})
    yield srv
    srv.close()


def loopback_urls(port: int, ipv6: bool) -> list[str]:
    """Every spelling of this machine's own addresses we know of."""
    hosts = ["127.0.0.1", "127.0.0.2", "2130706433", "0x7f000001", "0x7F000001", "0x7f.1", "0x7f.0.0.1",
             "0177.0.0.1", "0177.1", "017700000001", "127.1", "127.0.1", "127.000.000.001", "0", "0.0.0.0",
             "0x0", "00", "localhost", "LOCALHOST", "LocalHost", "localhost.", "loopback.test",
             "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[0:0:0:0:0:ffff:7f00:1]", "[::127.0.0.1]", "[::7f00:1]",
             "[::]", "[0::0]"]
    if ipv6:
        hosts += ["[::1]", "[0:0:0:0:0:0:0:1]", "[0000::0001]", "[::0:1]", "localhost6.test"]
    return [f"http://{h}:{port}/a.png" for h in hosts] + [f"https://{h}:{port}/a.png" for h in hosts[:4]]


def private_urls(port: int) -> list[str]:
    """Other non-public classes, by literal, numeric spelling and by name; none of them is ever
    contacted (the guard refuses a connect before any packet and records it)."""
    hosts = [a if ":" not in a else f"[{a}]" for a in NON_PUBLIC if not ipaddress.ip_address(a).is_loopback]
    hosts += ["2852039166", "0xa9fea9fe", "0251.0376.0251.0376", "169.254.43518", "0xa.0.0.1", "012.0.0.1",
              "167772161", "metadata.test", "internal.test", "mixed.test", "nxdomain.test"]
    return [f"http://{h}:{port}/a.png" for h in hosts]


NAMES = {"loopback.test": [["127.0.0.1"]], "localhost6.test": [["::1"]], "metadata.test": [["169.254.169.254"]],
         "internal.test": [["10.1.2.3"]], "mixed.test": [["8.8.8.8", "10.0.0.1"]],
         "nxdomain.test": [None]}


def _refused(url, policy, guard, listener):
    before = listener.count
    with pytest.raises(ValueError) as e:
        load_bytes(url, "image", policy)
    message = str(e.value)
    assert message == NOT_ALLOWED or message.startswith("malformed URL"), (url, message)
    assert listener.count == before, url
    assert not guard.attempts_to(listener.port) and not guard.non_loopback(), (url, guard.connects)


def test_loopback_spellings_are_refused_without_connecting(guard, listener):
    guard.names.update(NAMES)
    for url in loopback_urls(listener.port, listener.has_ipv6):
        _refused(url, MediaPolicy(), guard, listener)
    for url in loopback_urls(listener.port, listener.has_ipv6)[:3]:          # as video too
        with pytest.raises(ValueError, match="not allowed"):
            load_bytes(url.replace("a.png", "v.mp4"), "video", MediaPolicy())
    assert guard.connects == []


def test_other_non_public_addresses_are_refused_before_connect(guard, listener):
    guard.names.update(NAMES)
    for url in private_urls(listener.port):
        _refused(url, MediaPolicy(), guard, listener)
    assert guard.connects == []


def test_opt_in_reaches_the_listener(guard, listener):
    guard.names.update(NAMES)
    policy = MediaPolicy(allow_private_media_addresses=True)
    before = listener.count
    urls = [f"http://127.0.0.1:{listener.port}/a.png", f"http://localhost:{listener.port}/a.png",
            f"http://2130706433:{listener.port}/a.png", f"http://loopback.test:{listener.port}/a.png"]
    if listener.has_ipv6:
        urls.append(f"http://[::1]:{listener.port}/a.png")
    for url in urls:
        assert load_bytes(url, "image", policy) == IMAGE, url
    assert listener.count == before + len(urls)
    assert listener.hosts[-len(urls):] == [u.split("/")[2] for u in urls]      # Host: as in the URL
    assert not guard.non_loopback()


def test_allowed_domains_do_not_open_private_addresses(guard, listener):
    """A listed host is still refused at a non-public address (a listed public name can be
    rebound); with both flags it is fetched, and an unlisted host is refused."""
    guard.names.update({"images.corp.test": [["127.0.0.1"]]})
    url = f"http://images.corp.test:{listener.port}/a.png"
    listed = MediaPolicy.from_flags(allowed_media_domains="images.corp.test,localhost")
    _refused(url, listed, guard, listener)
    _refused(f"http://localhost:{listener.port}/a.png", listed, guard, listener)
    both = MediaPolicy.from_flags(allowed_media_domains="images.corp.test", allow_private_media_addresses=True)
    assert load_bytes(url, "image", both) == IMAGE
    with pytest.raises(ValueError, match="not in --allowed-media-domains"):
        load_bytes(f"http://localhost:{listener.port}/a.png", "image", both)


def test_dns_rebinding_cannot_switch_the_address(guard, listener):
    """The name resolves to a public address once, then to loopback: the fetcher asks once and
    connects to the address it checked (the guard refuses it before any packet), so the loopback
    listener is never reached. A check-then-connect-by-name fetcher would resolve twice."""
    guard.names["rebind.test"] = [["8.8.8.8"], ["127.0.0.1"]]
    before = listener.count
    with pytest.raises(ValueError, match="cannot fetch"):
        load_bytes(f"http://rebind.test:{listener.port}/a.png", "image", MediaPolicy())
    assert guard.lookups["rebind.test"] == 1
    assert guard.connects == [("8.8.8.8", listener.port)]
    assert listener.count == before


def test_redirects_are_not_followed(guard):
    target = CountingListener({"/a.png": ("image/png", IMAGE)})
    try:
        import http.server
        import threading

        class Redirect(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{target.port}/a.png")
                self.send_header("Content-Length", "0")
                self.end_headers()

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        with pytest.raises(ValueError, match="HTTP 302"):
            load_bytes(f"http://127.0.0.1:{srv.server_address[1]}/x.png", "image",
                       MediaPolicy(allow_private_media_addresses=True))
        assert target.count == 0
        srv.shutdown()
        srv.server_close()
    finally:
        target.close()


def test_https_keeps_the_hostname_for_sni_and_certificate(guard, tmp_path, monkeypatch):
    """Connected to the checked IP, TLS still names the URL's host: the server sees SNI
    media.test and the certificate for media.test verifies; the same server by IP does not."""
    import http.server
    import ssl
    import threading
    cert, key = self_signed(tmp_path, "media.test")
    seen = []
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.sni_callback = lambda sock, server_name, _: seen.append(server_name)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            seen.append(self.headers.get("Host"))
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            self.wfile.write(IMAGE)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    guard.names["media.test"] = [["127.0.0.1"]]
    policy = MediaPolicy(allow_private_media_addresses=True)
    try:
        assert load_bytes(f"https://media.test:{port}/a.png", "image", policy) == IMAGE
        assert seen == ["media.test", f"media.test:{port}"]
        with pytest.raises(ValueError, match="CERTIFICATE_VERIFY_FAILED|certificate"):
            load_bytes(f"https://127.0.0.1:{port}/a.png", "image", policy)
        with pytest.raises(ValueError, match="not allowed"):
            load_bytes(f"https://media.test:{port}/a.png", "image", MediaPolicy())
    finally:
        srv.shutdown()
        srv.server_close()
    assert not guard.non_loopback()


def test_processor_options_cannot_upscale_past_the_decode_bound():
    policy = MediaPolicy(max_image_pixels=1 << 20)
    check_upscale(ProcessorOptions(), policy)
    for key in ("min_pixels", "video_min_pixels"):
        big = ProcessorOptions.from_kwargs({key: 1 << 30, key.replace("min", "max"): 1 << 30})
        with pytest.raises(ValueError, match=f"mm_processor_kwargs.{key}: 1073741824 is more than"):
            check_upscale(big, policy)


# Peak memory of one decode, in a fresh interpreter: the peak resident size (VmHWM, KiB) before
# and after. (Not ru_maxrss: a child starts with its parent's, so a large pytest hides growth.)
_PEAK = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import av, numpy, PIL.Image, PIL.PngImagePlugin
    from m3serve.multimodal import media

    def peak_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    data = Path(sys.argv[2]).read_bytes()
    policy = media.MediaPolicy(**json.loads(sys.argv[3]))
    before = peak_kib()
    try:
        out = getattr(media, sys.argv[1])(data, policy)
        result = "decoded"
    except ValueError as e:
        result = str(e)
    after = peak_kib()
    print(json.dumps({"result": result, "growth_mib": round((after - before) / 1024, 1)}))
""")


def peak_growth(fn: str, data: bytes, tmp_path: Path, **policy) -> dict:
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux) to read peak memory")
    path = tmp_path / "media.bin"
    path.write_bytes(data)
    out = subprocess.run([sys.executable, "-c", _PEAK, fn, str(path), json.dumps(policy)], check=True,
                         capture_output=True, text=True, cwd=REPO_ROOT,
                         env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def blank_png(width: int, height: int) -> bytes:
    """A real, valid PNG of one (non-zero, so that decoding touches every page) colour: a few
    hundred KB that decode to width x height x 3 bytes."""
    import io

    from PIL import Image
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 120, 40)).save(out, format="PNG")
    return out.getvalue()


def test_image_bomb_is_refused_from_its_header(tmp_path):
    """A valid 6000 x 6000 PNG (36 M pixels, 103 MiB as RGB, under 200 KB on the wire): the
    default bound refuses it before decoding."""
    bomb = blank_png(6000, 6000)
    assert len(bomb) < 400_000
    r = peak_growth("decode_image", bomb, tmp_path)
    assert "6000x6000, more than" in r["result"], r
    assert r["growth_mib"] < 20, r


def blank_video(num_frames: int, width: int, height: int, fps: int = 25) -> bytes:
    import io

    import av
    import numpy as np
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), (200, 120, 40), np.uint8), format="rgb24")
        for _ in range(num_frames):
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def test_long_video_holds_only_the_sampled_frames(tmp_path):
    """600 frames of 320 x 240 (132 MiB of RGB if all were held): decoding keeps the 32 sampled."""
    pytest.importorskip("av")
    video = blank_video(600, 320, 240)
    r = peak_growth("decode_video", video, tmp_path)
    assert r["result"] == "decoded", r
    assert r["growth_mib"] < 40, r
    frames, fps = decode_video(video)
    assert frames.shape == (32, 240, 320, 3) and fps == pytest.approx(25 * 32 / 600)


def test_video_decoded_bytes_are_bounded(tmp_path):
    """32 frames of 640 x 480 sample to 28 MiB of RGB: past a 16 MiB bound it is refused before
    decoding; frames over the pixel bound are refused from the header; so is a frame count past
    the bound."""
    pytest.importorskip("av")
    video = blank_video(40, 640, 480)
    r = peak_growth("decode_video", video, tmp_path, max_video_decoded_bytes=16 << 20)
    assert "the 32 sampled 640x480 frames would decode to 29491200 bytes, more than 16777216" in r["result"], r
    assert r["growth_mib"] < 12, r
    with pytest.raises(ValueError, match="video frames are 640x480, more than 100000 pixels"):
        decode_video(video, MediaPolicy(max_image_pixels=100_000))
    with pytest.raises(ValueError, match="video has more than 20 frames"):
        decode_video(video, MediaPolicy(max_video_total_frames=20))
