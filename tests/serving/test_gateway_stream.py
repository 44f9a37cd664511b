"""The gateway's stream relay (clora.serving.gateway) against a mock engine."""

from __future__ import annotations

import asyncio

import httpx

from tests.serving.gateway_harness import Harness, default_vllm


def test_a_stream_vllm_failed_is_passed_on_counted_as_an_error_and_not_recorded(tmp_path):
    """vLLM reports a generation that failed mid-stream as an error event, then `[DONE]`: the
    client gets the error, and the cut-off completion is neither recorded (it would train) nor
    counted as answered."""
    sse = (b'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [1]}]}\n\n'
           b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
           b"data: [DONE]\n\n")

    def vllm(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("completions"):
            return httpx.Response(200, content=sse)
        return default_vllm(request)

    h = Harness(tmp_path, vllm)
    try:
        r = asyncio.run(h.call({"model": "acme", "messages": [{"role": "user", "content": "hi"}], "stream": True}))
    finally:
        h.close()
    assert b"engine died" in r.body and r.body.endswith(b"data: [DONE]\n\n")
    assert h.producer.acked == []

    def counted(status: str) -> float | None:
        return h.gateway.metrics.registry.get_sample_value("clora_gateway_requests_total",
                                                           {"tenant": "acme", "kind": "chat", "status": status})

    assert counted("500") == 1 and counted("200") is None
