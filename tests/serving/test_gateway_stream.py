"""The gateway's stream relay (clora.serving.gateway) against a mock engine."""

from __future__ import annotations

from clora.serving.completions import Recorder


def test_a_stream_vllm_failed_is_passed_on_counted_as_an_error_and_not_recorded():
    """vLLM reports a generation that failed mid-stream as an error event, then `[DONE]`: the
    client gets the error, and the cut-off completion is neither recorded (it would train) nor
    counted as answered."""
    import asyncio
    import contextlib
    import time
    from types import SimpleNamespace

    import httpx

    from clora.serving.gateway import Gateway
    from clora.serving.settings import GatewaySettings

    sse = (b'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [1]}]}\n\n'
           b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
           b"data: [DONE]\n\n")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=sse))
    submitted: list = []
    engine = SimpleNamespace(http=httpx.AsyncClient(transport=transport), mark_failed=lambda *a: None)
    gw = Gateway(GatewaySettings(), None, engine, None, SimpleNamespace(submit=submitted.append), None)
    body = {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    rec = Recorder(kind="chat", body=body, tenant="acme", interaction_id="chatcmpl-e", ref=None, client_model="base")

    async def relay() -> list[bytes]:
        lease = SimpleNamespace(replica=SimpleNamespace(index=0))
        response = await gw._stream("http://engine/v1/chat/completions", {}, rec, lease,
                                    contextlib.AsyncExitStack(), time.monotonic())
        return [chunk async for chunk in response.body_iterator]

    chunks = asyncio.run(relay())
    assert any(b"engine died" in c for c in chunks) and chunks[-1] == b"data: [DONE]\n\n"
    assert submitted == []
    def counted(status: str) -> float | None:
        return gw.metrics.registry.get_sample_value("clora_gateway_requests_total",
                                                    {"tenant": "acme", "kind": "chat", "status": status})

    assert counted("500") == 1 and counted("200") is None
