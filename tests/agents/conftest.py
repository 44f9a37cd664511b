"""Fixtures for the agents unit tests: one fake OpenAI server and one fake webhook per
session, reset before each test that uses them."""

from __future__ import annotations

import pytest

from .fakes import FakeOpenAI, FakeWebhook, ServerThread


@pytest.fixture(scope="session")
def _openai_server():
    fake = FakeOpenAI()
    server = ServerThread(fake.app).start()
    fake.url = server.url
    yield fake
    server.stop()


@pytest.fixture
def fake_openai(_openai_server):
    _openai_server.requests.clear()
    _openai_server.response_ids.clear()
    _openai_server.fail_next = 0
    _openai_server.policy = lambda body, i: "I don't know."
    return _openai_server


@pytest.fixture
def openai_client(fake_openai):
    import openai

    client = openai.OpenAI(base_url=fake_openai.url + "/v1", api_key="key-1", max_retries=0, timeout=10)
    yield client
    client.close()


@pytest.fixture(scope="session")
def _webhook_server():
    fake = FakeWebhook()
    server = ServerThread(fake.app).start()
    fake.url = server.url
    yield fake
    server.stop()


@pytest.fixture
def fake_webhook(_webhook_server):
    _webhook_server.script.clear()
    _webhook_server.attempts.clear()
    _webhook_server.accepted.clear()
    return _webhook_server
