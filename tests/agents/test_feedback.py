"""The platform's feedback client (`clora.agents.feedback`, the tenant SDK's `clora_client`) against the
suite's fake webhook: batching, 503 retries with the same event ids, 4xx errors, the platform's own
`FeedbackIn` records."""

import httpx
import pytest

from clora.agents.feedback import (AuthenticationError, FeedbackClient, FeedbackError, FeedbackRejected,
                                   FeedbackUnavailable)
from clora.ingest.schemas import FeedbackIn


@pytest.fixture
def sleeps():
    return []


@pytest.fixture
def client(fake_webhook, sleeps):
    with FeedbackClient(fake_webhook.url, "key-1", batch_size=3, max_attempts=3, sleep=sleeps.append) as c:
        yield c


def _records(n, **kw):
    return [FeedbackIn(interaction_id=f"chatcmpl-{i}", source="environment", score=float(i % 2), **kw)
            for i in range(n)]


def test_send_one_record_assigns_an_event_id(client, fake_webhook):
    eid = client.send({"interaction_id": "chatcmpl-1", "score": 1.0, "source": "environment"})
    assert eid.startswith("fb-")
    assert [(r.event_id, r.interaction_id, r.source, r.score) for r in fake_webhook.accepted] == [
        (eid, "chatcmpl-1", "environment", 1.0)]


def test_batches_are_split_and_keep_caller_event_ids(client, fake_webhook):
    recs = _records(7)
    recs[0] = recs[0].model_copy(update={"event_id": "env-chosen"})
    ids = client.send_batch(recs)
    assert ids[0] == "env-chosen" and len(set(ids)) == 7
    assert [len(a["records"]) for a in fake_webhook.attempts] == [3, 3, 1]
    assert [r.event_id for r in fake_webhook.accepted] == ids


def test_503_is_retried_with_the_same_event_ids(client, fake_webhook, sleeps):
    fake_webhook.script = [503, 503]
    ids = client.send_batch(_records(2))
    first, second, third = ([r["event_id"] for r in a["records"]] for a in fake_webhook.attempts)
    assert first == second == third == ids
    assert [r.event_id for r in fake_webhook.accepted] == ids
    # exponential back-off with up to backoff_s (0.2 s) of jitter; Retry-After 0 asks for no more
    assert 0.2 <= sleeps[0] <= 0.4 and 0.4 <= sleeps[1] <= 0.6 and len(sleeps) == 2


def test_gives_up_after_max_attempts_saying_why(client, fake_webhook):
    fake_webhook.script = [503, 503, 503]
    with pytest.raises(FeedbackUnavailable, match=r"/v1/feedback with 1 record\(s\) failed 3 times; last: 503: retry"):
        client.send(_records(1)[0])
    assert len(fake_webhook.attempts) == 3 and fake_webhook.accepted == []


@pytest.mark.parametrize("status", [400, 413, 422])
def test_client_errors_raise_at_once_with_the_status(client, fake_webhook, status):
    fake_webhook.script = [status]
    with pytest.raises(FeedbackRejected, match=f"with {status} scripted: scripted {status}") as e:
        client.send_batch(_records(2))
    assert e.value.status == status and len(e.value.event_ids) == 2
    assert len(fake_webhook.attempts) == 1


def test_a_500_is_retried_with_the_same_event_ids(client, fake_webhook):
    fake_webhook.script = [500]
    (eid,) = client.send_batch(_records(1))
    assert [a["records"][0]["event_id"] for a in fake_webhook.attempts] == [eid, eid]
    assert [r.event_id for r in fake_webhook.accepted] == [eid]


def test_bad_key_is_rejected(fake_webhook):
    with FeedbackClient(fake_webhook.url, "wrong", sleep=lambda s: None) as c:
        with pytest.raises(AuthenticationError, match="401 unauthorized: bad API key") as e:
            c.send(_records(1)[0])
    assert isinstance(e.value, FeedbackError) and e.value.status == 401


def test_invalid_records_fail_before_sending(client, fake_webhook):
    with pytest.raises(ValueError, match="feedback needs at least one of score, correction, comment"):
        client.send({"interaction_id": "chatcmpl-1"})
    assert fake_webhook.attempts == []


def test_connection_errors_are_retried():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        return httpx.Response(202, json={"accepted": 1, "event_ids": ["x"]})

    with FeedbackClient("http://webhook", "k", transport=httpx.MockTransport(handler), sleep=lambda s: None) as c:
        c.send(_records(1)[0])
    assert len(calls) == 2 and calls[0].content == calls[1].content
