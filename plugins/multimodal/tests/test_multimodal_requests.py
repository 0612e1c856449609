"""Image parts on every protocol, the media sources and limits, and the 422s (never a 500) of spec §1.3."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mm_helpers import data_url, image_png, make_tiny_llava, mm_config

from mindie_host.testing import RunningServer, load_host, make_tiny_llama, server_config

N = 6


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(image_png(56, 56, 11))
    (d / "big.png").write_bytes(b"\x89PNG" + b"\0" * (20 * 1024 * 1024 + 10))
    return d


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("local-cache")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, media_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCAL_CACHE_DIR", str(cache_dir))
    model = make_tiny_llava(tmp_path_factory.mktemp("tiny-llava-req"))
    cfg = mm_config(model, plugins={"multimodal": {"allowedLocalMediaPath": [str(media_dir)]}})
    try:
        with RunningServer(cfg) as s:
            yield s
    finally:
        mp.undo()


def _items(url: str, kind: str = "image_url") -> list[dict[str, Any]]:
    return [{"type": "text", "text": "Describe "}, {"type": kind, kind: url}, {"type": "text", "text": " briefly."}]


def _tgi(server: RunningServer, items: Any) -> httpx.Response:
    return httpx.post(server.url + "/generate", json={"inputs": items, "parameters": {"max_new_tokens": N}},
                      timeout=120)


def test_every_protocol_takes_image_parts_with_the_same_result(server: RunningServer, media_dir: Path) -> None:
    png = (media_dir / "cat.png").read_bytes()
    url = data_url(png)
    tgi = _tgi(server, _items(url))
    assert tgi.status_code == 200, tgi.text
    text = tgi.json()["generated_text"]
    vllm = httpx.post(server.url + "/generate", json={"prompt": _items(url), "max_tokens": N, "temperature": 0},
                      timeout=120)
    assert vllm.status_code == 200, vllm.text
    assert vllm.json()["text"][0].endswith(text)
    triton = httpx.post(server.url + "/v2/models/tiny/generate", json={
        "id": "mm1", "text_input": _items(url), "parameters": {"max_new_tokens": N}}, timeout=120)
    assert triton.status_code == 200, triton.text
    assert triton.json()["text_output"] == text
    native = httpx.post(server.url + "/infer", json={"inputs": _items(url), "parameters": {"max_new_tokens": N}},
                        timeout=120)
    assert native.status_code == 200, native.text
    assert text in native.text
    # the spec's bare "base64-encoded jpg" (no data: prefix) is the same image
    bare = _tgi(server, _items(base64.b64encode(png).decode()))
    assert bare.status_code == 200, bare.text
    assert bare.json()["generated_text"] == text
    # a server-local file inside allowedLocalMediaPath is the same image
    local = _tgi(server, _items(str(media_dir / "cat.png")))
    assert local.status_code == 200, local.text
    assert local.json()["generated_text"] == text
    # OpenAI: the {"url": ...} object and MindIE's plain string
    for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image_url", "image_url": url}):
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": N, "temperature": 0,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 16  # the 16 placeholder tokens count as prompt tokens


def test_received_images_are_cached_under_local_cache_dir(server: RunningServer, cache_dir: Path) -> None:
    import hashlib

    png = image_png(56, 56, 12)
    assert _tgi(server, _items(data_url(png))).status_code == 200
    assert (cache_dir / f"{hashlib.sha256(png).hexdigest()}.img").read_bytes() == png


def _error(r: httpx.Response) -> str:
    assert r.status_code == 422, (r.status_code, r.text)
    return r.text


def test_spec_errors_are_422(server: RunningServer, media_dir: Path) -> None:
    png = data_url(image_png(56, 56, 13))
    assert "Request param image_url null." in _error(_tgi(server, _items("")))
    assert "Request param image_url null." in _error(_tgi(server, _items("   ")))
    assert "video_url" in _error(_tgi(server, _items("/x/clip.mp4", "video_url")))
    assert "audio_url" in _error(_tgi(server, _items("/x/a.wav", "audio_url")))
    many = [{"type": "image_url", "image_url": png}] * 21 + [{"type": "text", "text": "all"}]
    assert "The number of multimodal url. should be no more than 20." in _error(_tgi(server, many))
    fail = "[InferTokenizer::DownloadUrl] download fail"
    assert fail in _error(_tgi(server, _items("/etc/hostname")))  # outside the allow-list
    assert fail in _error(_tgi(server, _items(str(media_dir / "missing.png"))))
    assert fail in _error(_tgi(server, _items(str(media_dir / "big.png"))))  # over 20 MB
    assert fail in _error(_tgi(server, _items("http://127.0.0.1:9/x.png")))  # http off by default
    not_image = "data:image/png;base64," + base64.b64encode(b"plain text").decode()
    assert fail in _error(_tgi(server, _items(not_image)))
    assert fail in _error(_tgi(server, _items("data:image/png;base64,@@@")))
    # 20 images (320 placeholder tokens) and a long text: over maxInputTokenLen (400) once widened
    over = [{"type": "image_url", "image_url": png}] * 20 + [{"type": "text", "text": "word " * 120}]
    assert "placeholder tokens; the limit is 400" in _error(_tgi(server, over))
    # the image text typed by hand, without an image part
    assert "image placeholder" in _error(_tgi(server, [{"type": "text", "text": "look <image> here"}]))
    # the same checks on the OpenAI route, in its error format
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}]}, timeout=60)
    assert "Request param image_url null." in _error(r)
    assert server.host.stats().get("num_running", 0) == 0


def test_plugin_off_refuses_image_parts(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-text"))
    png = data_url(image_png(28, 28, 1))
    with RunningServer(server_config(model)) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": png}}]}]},
            timeout=60)
        assert r.status_code == 422 and "multimodal" in r.json()["error"]["message"], r.text
        r = httpx.post(s.url + "/generate", json={"inputs": _items(png), "parameters": {"max_new_tokens": 4}},
                       timeout=60)
        assert r.status_code == 422 and "multimodal" in r.text, r.text


def test_config_is_checked(tmp_path_factory: pytest.TempPathFactory) -> None:
    from mindie_host.api import PluginError

    text_model = make_tiny_llama(tmp_path_factory.mktemp("tiny-text-cfg"))
    bad = mm_config(text_model, plugins={"multimodal": {"allowHttp": "yes", "colour": 1}})
    with pytest.raises(PluginError) as info:
        load_host(bad)
    msg = str(info.value)
    assert "allowHttp" in msg and "colour" in msg and "not a multimodal model" in msg
    assert json.loads(bad["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"])


def test_http_images_when_allowed(tmp_path_factory: pytest.TempPathFactory, media_dir: Path) -> None:
    """``allowHttp``: an http URL is fetched (here from a loopback file server); a failed fetch is a 422."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    model = make_tiny_llava(tmp_path_factory.mktemp("tiny-llava-http"))
    try:
        with RunningServer(mm_config(model, plugins={"multimodal": {"allowHttp": True, "httpTimeoutS": 5}})) as s:
            by_url = _tgi(s, _items(f"{base}/cat.png"))
            inline = _tgi(s, _items(data_url((media_dir / "cat.png").read_bytes())))
            missing = _tgi(s, _items(f"{base}/missing.png"))
    finally:
        files.shutdown()
    assert by_url.status_code == 200, by_url.text
    assert by_url.json()["generated_text"] == inline.json()["generated_text"]
    assert "[InferTokenizer::DownloadUrl] download fail: HTTPError" in _error(missing)
