"""The client against an in-process webhook (httpx.MockTransport): event ids, batching within the
webhook's limits, retries with the same bytes, Retry-After, errors from the envelope, signing."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time

import httpx
import pytest

from clora_client import (AsyncFeedbackClient, AuthenticationError, ClientError, FeedbackClient, FeedbackRecord,
                          FeedbackRejected, FeedbackUnavailable, InvalidFeedback)


class Webhook:
    """Answers the (status, error, headers) queued in `script` (status 0: the connection breaks;
    None: answered as usual), then 202; records every request."""

    def __init__(self):
        self.script: list[tuple[int, dict, dict] | None] = []
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.script.pop(0) if self.script else None
        if answer is not None:
            status, error, headers = answer
            if status == 0:
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(status, json={"error": error}, headers=headers)
        body = json.loads(request.content)
        ids = [r["event_id"] for r in body.get("records", [body])]
        return httpx.Response(202, json={"accepted": len(ids), "event_ids": ids})

    def bodies(self) -> list[dict]:
        return [json.loads(r.content) for r in self.requests]


@pytest.fixture
def webhook():
    return Webhook()


@pytest.fixture
def sleeps():
    return []


def client(webhook, sleeps, **kw) -> FeedbackClient:
    return FeedbackClient("http://webhook/", "key-1", transport=httpx.MockTransport(webhook), sleep=sleeps.append,
                          **kw)


def records(n: int) -> list[dict]:
    return [{"interaction_id": f"chatcmpl-{i}", "score": 1.0, "source": "environment"} for i in range(n)]


def test_send_names_the_record_and_posts_it_with_the_key(webhook, sleeps):
    with client(webhook, sleeps) as c:
        eid = c.send({"interaction_id": "chatcmpl-1", "score": 1})
    (req,) = webhook.requests
    assert eid.startswith("fb-") and len(eid) == 35
    assert req.url.path == "/v1/feedback" and req.headers["authorization"] == "Bearer key-1"
    assert json.loads(req.content) == {"interaction_id": "chatcmpl-1", "event_id": eid, "source": "user",
                                       "score": 1.0}
    assert "x-clora-signature" not in req.headers


def test_a_batch_is_split_by_count_and_keeps_the_callers_event_ids(webhook, sleeps):
    recs = records(7)
    recs[2]["event_id"] = "env-chosen"
    with client(webhook, sleeps, batch_size=3) as c:
        ids = c.send_batch(recs)
    assert ids[2] == "env-chosen" and len(set(ids)) == 7
    assert [len(b["records"]) for b in webhook.bodies()] == [3, 3, 1]
    assert [r["event_id"] for b in webhook.bodies() for r in b["records"]] == ids


def test_a_batch_is_split_so_that_no_body_passes_the_byte_limit(webhook, sleeps):
    recs = [{"interaction_id": f"chatcmpl-{i}", "comment": "x" * 300} for i in range(10)]
    with client(webhook, sleeps, max_body_bytes=1024) as c:
        ids = c.send_batch(recs)
    sizes = [len(r.content) for r in webhook.requests]
    assert max(sizes) <= 1024 and len(sizes) > 3
    assert [r["event_id"] for b in webhook.bodies() for r in b["records"]] == ids


def test_an_empty_batch_sends_nothing(webhook, sleeps):
    with client(webhook, sleeps) as c:
        assert c.send_batch([]) == []
    assert webhook.requests == []


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_429_and_5xx_are_retried_with_the_same_bytes(webhook, sleeps, status):
    webhook.script = [(status, {"code": "busy", "message": "later"}, {})] * 2
    with client(webhook, sleeps, max_attempts=3) as c:
        ids = c.send_batch(records(2))
    first, second, third = (r.content for r in webhook.requests)
    assert first == second == third
    assert [r["event_id"] for r in webhook.bodies()[2]["records"]] == ids
    assert len(sleeps) == 2


def test_connection_errors_are_retried(webhook, sleeps):
    webhook.script = [(0, {}, {})]
    with client(webhook, sleeps) as c:
        c.send(records(1)[0])
    assert len(webhook.requests) == 2 and webhook.requests[0].content == webhook.requests[1].content


def test_back_off_grows_exponentially_with_bounded_jitter(webhook, sleeps):
    webhook.script = [(503, {"message": "retry"}, {})] * 4
    with client(webhook, sleeps, max_attempts=5, backoff_s=0.1, max_backoff_s=0.5, jitter_s=0.05) as c:
        c.send(records(1)[0])
    assert len(sleeps) == 4
    for s, base in zip(sleeps, [0.1, 0.2, 0.4, 0.5]):
        assert base <= s <= min(base + 0.05, 0.5)


def test_retry_after_is_waited_when_longer_than_the_back_off(webhook, sleeps):
    webhook.script = [(429, {"code": "quota_exceeded", "message": "retry in 3 s"}, {"Retry-After": "3"})]
    with client(webhook, sleeps, backoff_s=0.1, jitter_s=0) as c:
        c.send(records(1)[0])
    assert sleeps == [3.0]


def test_retry_after_is_capped(webhook, sleeps):
    webhook.script = [(503, {"message": "retry"}, {"Retry-After": "86400"})]
    with client(webhook, sleeps, max_retry_after_s=7) as c:
        c.send(records(1)[0])
    assert sleeps == [7]


def test_giving_up_says_why_and_which_records(webhook, sleeps):
    webhook.script = [(503, {"code": "broker_unavailable", "message": "retry"}, {})] * 3
    with client(webhook, sleeps, max_attempts=3) as c:
        with pytest.raises(FeedbackUnavailable, match=r"/v1/feedback with 1 record\(s\) failed 3 times; "
                                                      r"last: 503: retry") as e:
            c.send({"interaction_id": "chatcmpl-1", "event_id": "mine", "score": 0})
    assert e.value.status == 503 and e.value.event_ids == ["mine"] and isinstance(e.value, ClientError)
    assert len(webhook.requests) == 3


def test_an_unreachable_webhook_is_unavailable_with_no_status(webhook, sleeps):
    webhook.script = [(0, {}, {})] * 2
    with client(webhook, sleeps, max_attempts=2) as c:
        with pytest.raises(FeedbackUnavailable, match="ConnectError: refused") as e:
            c.send(records(1)[0])
    assert e.value.status is None


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_other_4xx_raise_at_once_with_the_envelope(webhook, sleeps, status):
    webhook.script = [(status, {"code": "invalid_request", "message": "records.1.score: too big",
                                "field": "records.1.score"}, {})]
    with client(webhook, sleeps) as c:
        with pytest.raises(FeedbackRejected, match=f"with {status} invalid_request: records.1.score: too big "
                                                   r"\(field records.1.score\)") as e:
            ids = c.send_batch(records(3))
    err = e.value
    assert (err.status, err.code, err.field) == (status, "invalid_request", "records.1.score")
    assert not isinstance(err, AuthenticationError) and len(err.event_ids) == 3
    assert err.rejected_event_id == err.event_ids[1] == webhook.bodies()[0]["records"][1]["event_id"]
    assert len(webhook.requests) == 1 and sleeps == []


@pytest.mark.parametrize("status,code", [(401, "bad_signature"), (403, "forbidden")])
def test_401_and_403_are_authentication_errors(webhook, sleeps, status, code):
    webhook.script = [(status, {"code": code, "message": "no", "field": None}, {})]
    with client(webhook, sleeps) as c:
        with pytest.raises(AuthenticationError) as e:
            c.send(records(1)[0])
    assert isinstance(e.value, FeedbackRejected) and e.value.status == status and e.value.code == code
    assert len(webhook.requests) == 1


def test_a_failed_batch_says_which_earlier_batches_were_stored(webhook, sleeps):
    webhook.script = [None, (422, {"code": "invalid_request", "message": "no"}, {})]
    with client(webhook, sleeps, batch_size=2) as c:
        with pytest.raises(FeedbackRejected) as e:
            c.send_batch(records(5))
    stored, refused = ([r["event_id"] for r in b["records"]] for b in webhook.bodies())
    assert e.value.accepted == stored and e.value.event_ids == refused and len(webhook.requests) == 2


def test_invalid_records_fail_before_anything_is_sent_naming_the_field(webhook, sleeps):
    with client(webhook, sleeps) as c:
        with pytest.raises(InvalidFeedback, match="feedback needs at least one of score, correction, comment"):
            c.send({"interaction_id": "chatcmpl-1"})
        with pytest.raises(InvalidFeedback, match=r"records\.1\.score") as e:
            c.send_batch([records(1)[0], {"interaction_id": "chatcmpl-2", "score": float("nan")}])
    assert e.value.field == "records.1.score" and isinstance(e.value, ValueError)
    assert webhook.requests == []


def test_text_goes_as_utf8_and_a_lone_surrogate_is_refused_as_the_webhook_refuses_it(webhook, sleeps):
    with client(webhook, sleeps) as c:
        c.send({"interaction_id": "chatcmpl-1", "comment": "caf\u00e9"})
        with pytest.raises(InvalidFeedback, match="comment"):
            c.send({"interaction_id": "chatcmpl-1", "comment": "caf\u00e9 \ud800"})
    (plain,) = webhook.requests
    assert "caf\u00e9".encode() in plain.content


def test_a_signed_client_signs_each_attempt_as_the_webhook_checks(webhook, sleeps):
    webhook.script = [(503, {"message": "retry"}, {})]
    before = int(time.time())
    with client(webhook, sleeps, signing_secret="s3cret") as c:
        c.send(records(1)[0])
    for req in webhook.requests:
        ts = req.headers["x-clora-timestamp"]
        expected = hmac.new(b"s3cret", ts.encode() + b"." + req.content, hashlib.sha256).hexdigest()
        assert req.headers["x-clora-signature"] == "sha256=" + expected
        assert before <= int(ts) <= time.time()


def test_helpers_send_the_usual_kinds_of_feedback(webhook, sleeps):
    completion = {"id": "chatcmpl-9", "choices": [{"index": 0, "message": {"content": "5"}}]}
    with client(webhook, sleeps) as c:
        c.thumbs(completion, up=True)
        c.rating("chatcmpl-9", 4)
        c.reward("chatcmpl-9", 0.5, key="exact")
        c.correction("chatcmpl-9", "4")
        c.preference("chatcmpl-9", {"role": "assistant", "content": "four"})
        c.comment("chatcmpl-9", "terse")
    sent = [{k: v for k, v in b.items() if k != "event_id"} for b in webhook.bodies()]
    assert sent == [
        {"interaction_id": "chatcmpl-9", "source": "user", "score": 1.0, "key": "thumbs"},
        {"interaction_id": "chatcmpl-9", "source": "user", "score": 4.0, "key": "rating"},
        {"interaction_id": "chatcmpl-9", "source": "environment", "score": 0.5, "key": "exact"},
        {"interaction_id": "chatcmpl-9", "source": "operator", "correction": {"role": "assistant", "content": "4"}},
        {"interaction_id": "chatcmpl-9", "source": "user", "correction": {"role": "assistant", "content": "four"}},
        {"interaction_id": "chatcmpl-9", "source": "user", "comment": "terse"},
    ]


def test_a_record_of_another_pydantic_model_is_sent_as_its_fields(webhook, sleeps):
    from pydantic import BaseModel

    class Theirs(BaseModel):
        interaction_id: str
        score: float | None = None
        comment: str | None = None

    with client(webhook, sleeps) as c:
        eid = c.send(Theirs(interaction_id="chatcmpl-1", score=0.0))
    assert webhook.bodies() == [{"interaction_id": "chatcmpl-1", "event_id": eid, "source": "user", "score": 0.0}]
    assert FeedbackRecord.model_validate(webhook.bodies()[0]).event_id == eid


def test_the_async_client_batches_retries_and_signs_the_same_way(webhook):
    webhook.script = [(503, {"message": "retry"}, {}), (0, {}, {})]
    waits = []

    async def sleep(s):
        waits.append(s)

    async def main():
        async with AsyncFeedbackClient("http://webhook", "key-1", transport=httpx.MockTransport(webhook),
                                       sleep=sleep, batch_size=2, signing_secret="s") as c:
            ids = await c.send_batch(records(3))
            one = await c.thumbs("chatcmpl-1", up=False)
            return ids, one

    ids, one = asyncio.run(main())
    assert len(waits) == 2 and webhook.requests[0].content == webhook.requests[2].content
    assert [r["event_id"] for b in webhook.bodies()[2:4] for r in b["records"]] == ids
    assert webhook.bodies()[-1]["event_id"] == one
    assert all(r.headers["x-clora-signature"].startswith("sha256=") for r in webhook.requests)


def test_the_async_client_raises_the_same_errors(webhook):
    webhook.script = [(401, {"code": "invalid_api_key", "message": "unknown or revoked API key"}, {})]

    async def main():
        async with AsyncFeedbackClient("http://webhook", "key-1", transport=httpx.MockTransport(webhook)) as c:
            await c.send(records(1)[0])

    with pytest.raises(AuthenticationError, match="401 invalid_api_key: unknown or revoked API key"):
        asyncio.run(main())
