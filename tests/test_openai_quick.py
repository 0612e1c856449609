from __future__ import annotations

import httpx
import openai


def test_chat_roundtrip(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    bad = httpx.post(tiny_server.url + "/v1/chat/completions", json={"model": "tiny", "messages": [], "temperature": -1})
    assert bad.status_code == 422
