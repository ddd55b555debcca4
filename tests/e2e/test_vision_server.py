"""Images over Chat Completions through the `openai` client on the tiny vision checkpoint:
data URLs, a local http server's URLs and file:// URLs, streaming and not, answer as the offline
engine does; the image tokens count in usage; every bad image, URL or count is a 400 naming
the part and the reason, and the server keeps serving."""
import http.server
import sys
import threading
from pathlib import Path

import openai
import pytest

from serverutil import MODEL_NAME, LiveServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))
from media_samples import BAD_IMAGES, data_url, png_bytes  # noqa: E402

IMAGE = png_bytes(150, 100, seed=21)
OTHER = png_bytes(90, 120, seed=22)


@pytest.fixture(scope="module")
def media_host():
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            body = {"/a.png": IMAGE, "/b.png": OTHER}.get(self.path)
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "a.png").write_bytes(IMAGE)
    return d


@pytest.fixture(scope="module")
def vision_server(tiny_vision_dir, media_dir, tmp_path_factory):
    srv = LiveServer(tiny_vision_dir, "--dtype", "float32", "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
                     "--allowed-local-media-path", str(media_dir), "--allowed-media-domains", "127.0.0.1",
                     "--allow-private-media-addresses", log_path=tmp_path_factory.mktemp("logs") / "vision.log")
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log_path.read_text()


@pytest.fixture(scope="module")
def client(vision_server):
    return openai.OpenAI(base_url=vision_server.url + "/v1", api_key="unused", max_retries=0)


def messages(*urls, text="describe"):
    content = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def offline(tiny_vision_dir):
    """The offline engine's greedy answers (itself equal to transformers: tests/multimodal)."""
    from m3serve.llm import LLM
    from m3serve.sampling_params import SamplingParams
    llm = LLM(model=str(tiny_vision_dir), dtype="float32")

    def answer(msgs):
        out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        return out.outputs[0].text, len(out.prompt_token_ids)
    return answer


def ask(client, msgs, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}, **kw)


def test_data_http_and_file_urls_answer_as_offline(client, offline, media_host, media_dir):
    text, num_prompt = offline(messages(data_url(IMAGE), data_url(OTHER)))
    for urls in ([data_url(IMAGE), data_url(OTHER)], [media_host + "/a.png", media_host + "/b.png"],
                 [f"file://{media_dir}/a.png", data_url(OTHER)]):
        r = ask(client, messages(*urls))
        assert r.choices[0].message.content == text, urls[0][:20]
        assert r.usage.prompt_tokens == num_prompt > 2 * 20      # the image tokens are counted
    stream = ask(client, messages(data_url(IMAGE), data_url(OTHER)), stream=True,
                 stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == num_prompt


def test_another_image_answers_differently(client, offline):
    assert ask(client, messages(data_url(OTHER))).choices[0].message.content == offline(messages(data_url(OTHER)))[0]


@pytest.mark.parametrize("name,data,phrase", BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_bad_images_are_400(client, name, data, phrase):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, messages(data_url(data)))
    assert "messages[0].content[1]" in e.value.message and phrase in e.value.message, e.value.message


@pytest.mark.parametrize("url,phrase", [
    ("http://127.0.0.1:1/a.png", "cannot fetch"),
    ("{host}/missing.png", "HTTP 404"),
    ("http://localhost:9/a.png", "not in --allowed-media-domains"),
    ("file:///etc/passwd", "outside --allowed-local-media-path"),
    ("gopher://x/a.png", "unsupported URL scheme"),
    ("data:image/png;base64,!!!", "not valid base64"),
])
def test_bad_urls_are_400(client, media_host, url, phrase):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, messages(url.format(host=media_host)))
    assert "messages[0].content[1]" in e.value.message and phrase in e.value.message, e.value.message


def test_counts_and_markers_are_400(client):
    with pytest.raises(openai.BadRequestError, match="too many images in one prompt: 3, at most 2"):
        ask(client, messages(*[data_url(IMAGE)] * 3))
    with pytest.raises(openai.BadRequestError, match="marker"):
        ask(client, [{"role": "user", "content": "a literal ]<]image[>[ without a part"}])
    with pytest.raises(openai.BadRequestError, match="image_url.url"):
        ask(client, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    # still serving
    assert ask(client, messages(data_url(IMAGE))).choices[0].finish_reason == "length"


def test_text_only_model_refuses_images(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="without a vision tower"):
        ask(c, messages(data_url(IMAGE)))


def test_anthropic_image_blocks(vision_server, client):
    """A Messages request with a base64 image block (and one by URL) answers as Chat Completions
    does for the same turn; a bad one is a 400 naming the block."""
    import base64

    import anthropic
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages(data_url(IMAGE)), max_tokens=8,
                                          temperature=0)
    claude = anthropic.Anthropic(base_url=vision_server.url, api_key="unused", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(IMAGE).decode()}}
    r = claude.messages.create(model=MODEL_NAME, max_tokens=8, extra_body={"temperature": 0.0}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "describe"}, block]}])
    assert "".join(b.text for b in r.content if b.type == "text") == chat.choices[0].message.content
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                       "data": base64.b64encode(IMAGE[:300]).decode()}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL_NAME, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "text", "text": "x"}, bad]}])
    assert "messages.0.content.1: corrupt or truncated" in str(e.value)


def test_responses_input_image(vision_server, client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages(data_url(IMAGE)), max_tokens=8,
                                          temperature=0)
    r = client.responses.create(model=MODEL_NAME, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "describe"},
                                     {"type": "input_image", "image_url": data_url(IMAGE)}]}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL_NAME, max_output_tokens=8, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": data_url(b"nope")}]}])
    assert "input[0].content[0]: not a recognised image format" in e.value.message


def test_video_url(client, offline):
    """A video file by data URL: decoded with PyAV, answered as the offline engine does with the
    same bytes (timestamps in the prompt); a file that is no video is a 400."""
    pytest.importorskip("av")
    from media_samples import mp4_bytes
    url = data_url(mp4_bytes(), "video/mp4")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what happens"},
                                         {"type": "video_url", "video_url": {"url": url}}]}]
    text, num_prompt = offline(msgs)
    r = ask(client, msgs)
    assert r.choices[0].message.content == text and r.usage.prompt_tokens == num_prompt
    msgs[0]["content"][1]["video_url"]["url"] = data_url(b"\x00" * 200, "video/mp4")
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[1\]: cannot decode the video"):
        ask(client, msgs)


def test_tokenize_and_render_count_the_image(vision_server, client, offline):
    import httpx
    msgs = messages(data_url(IMAGE))
    _, num_prompt = offline(msgs)
    r = httpx.post(vision_server.url + "/tokenize", json={"model": MODEL_NAME, "messages": msgs}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] == num_prompt
    r = httpx.post(vision_server.url + "/v1/chat/completions/render", json={"model": MODEL_NAME, "messages": msgs},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["token_ids"]) == num_prompt


def test_bench_image_workload(vision_server):
    """`m3serve bench serve --dataset-name random-mm`: every request carries its images and the
    server counts their tokens in each prompt (two images of 224² or 336²: at least 2 x 64
    placeholders)."""
    import argparse

    from m3serve.bench import serve
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--base-url", vision_server.url, "--backend", "openai-chat", "--model", MODEL_NAME,
                              "--tokenizer", str(vision_server_model(vision_server)), "--dataset-name", "random-mm",
                              "--random-mm-base-items-per-request", "2", "--random-mm-image-sizes", "224x224,336x336",
                              "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "3",
                              "--ignore-eos", "--disable-tqdm"])
    result = serve.main(args)
    assert result["completed"] == 3 and result["failed"] == 0
    assert result["total_input_tokens"] >= 3 * (16 + 2 * 64)


def vision_server_model(server):
    import httpx
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["root"]
