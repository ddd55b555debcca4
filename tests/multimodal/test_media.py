"""Media references and decoding: data / file / http URLs within their limits, and every kind
of bad image refused with a ValueError that says why."""
import http.server
import threading

import pytest

from m3serve.multimodal.media import MediaPolicy, decode_image, load_bytes
from media_samples import BAD_IMAGES, data_url, jpeg_bytes, png_bytes


@pytest.mark.parametrize("name,data,phrase", BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_bad_images_are_refused(name, data, phrase):
    policy = MediaPolicy(max_image_pixels=4096 * 4096)
    with pytest.raises(ValueError, match=phrase):
        decode_image(load_bytes(data_url(data), "image", policy), policy)


def test_good_images_decode():
    assert decode_image(png_bytes(64, 48)).size == (64, 48)
    assert decode_image(jpeg_bytes(30, 20)).size == (30, 20)
    assert decode_image(load_bytes(data_url(png_bytes(5, 7, mode="RGBA")), "image", MediaPolicy())).mode == "RGBA"


def test_data_url_checks():
    policy = MediaPolicy(max_image_bytes=1000)
    with pytest.raises(ValueError, match="larger than 1000 bytes"):
        load_bytes(data_url(png_bytes(100, 100)), "image", policy)
    with pytest.raises(ValueError, match="not valid base64"):
        load_bytes("data:image/png;base64,@@@@", "image", policy)
    with pytest.raises(ValueError, match="'text/plain' is not an image type"):
        load_bytes("data:text/plain;base64,aGVsbG8=", "image", policy)
    with pytest.raises(ValueError, match="unsupported URL scheme 'ftp'"):
        load_bytes("ftp://example.com/a.png", "image", policy)


def test_file_urls_only_under_the_allowed_directory(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "a.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    with pytest.raises(ValueError, match="not allowed"):
        load_bytes(f"file://{inside}/a.png", "image", MediaPolicy())
    policy = MediaPolicy.from_flags(allowed_local_media_path=str(inside))
    assert load_bytes(f"file://{inside}/a.png", "image", policy) == png_bytes()
    with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
        load_bytes(f"file://{inside}/../secret.png", "image", policy)


@pytest.fixture(scope="module")
def media_server():
    """A local HTTP server: /a.png, /text (text/plain), /big (declares a huge length), /slow."""
    import time
    body = png_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path == "/slow":
                time.sleep(2)
            if self.path == "/missing":
                self.send_response(404)
                self.end_headers()
                return
            ctype = "text/plain" if self.path == "/text" else "image/png"
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(10**9 if self.path == "/big" else len(body)))
            self.end_headers()
            if self.path != "/big":
                try:
                    self.wfile.write(body)
                except BrokenPipeError:          # the client gave up (the timeout case)
                    pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", body
    server.shutdown()


def test_http_urls(media_server):
    """The local server is at a loopback address: reachable only with the opt-in."""
    url, body = media_server
    local = MediaPolicy(allow_private_media_addresses=True)
    assert load_bytes(url + "/a.png", "image", local) == body
    with pytest.raises(ValueError, match="not allowed: it does not resolve to a public address"):
        load_bytes(url + "/a.png", "image", MediaPolicy())
    with pytest.raises(ValueError, match="'text/plain' is not an image"):
        load_bytes(url + "/text", "image", local)
    with pytest.raises(ValueError, match="larger than"):
        load_bytes(url + "/big", "image", local)
    with pytest.raises(ValueError, match="HTTP 404"):
        load_bytes(url + "/missing", "image", local)
    with pytest.raises(ValueError, match="longer than 0.5 s"):
        load_bytes(url + "/slow", "image", MediaPolicy(fetch_timeout_s=0.5, allow_private_media_addresses=True))
    with pytest.raises(ValueError, match="not in --allowed-media-domains"):
        load_bytes(url + "/a.png", "image", MediaPolicy.from_flags(allowed_media_domains="example.com"))
    with pytest.raises(ValueError, match="cannot fetch"):
        load_bytes("http://127.0.0.1:1/a.png", "image", local)
