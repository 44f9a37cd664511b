"""Fuzz the webhook from its own OpenAPI spec (schemathesis strategies driven by hypothesis,
with the real broker and Redis behind it): whatever the body or key, it never answers 5xx."""

from __future__ import annotations

import uuid

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.integration
PATHS = ["/v1/feedback", "/v1/feedback/batch"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("with_key", [True, False])
def test_fuzzed_requests_never_5xx(webhook, registry, path, with_key):
    key = registry.create_tenant(f"fuzz-{uuid.uuid4().hex[:8]}")[1]
    schema = schemathesis.openapi.from_url(f"{webhook.url}/openapi.json")
    strategy = schema[path]["POST"].as_strategy()
    allowed = {202, 401, 403, 413, 422} if with_key else {401, 413}
    seen: set[int] = set()

    @settings(max_examples=50 if with_key else 15, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    @given(case=strategy)
    def run(case):
        headers = {"Authorization": f"Bearer {key}"} if with_key else {}
        response = case.call(headers=headers)
        seen.add(response.status_code)
        assert response.status_code in allowed, f"{response.status_code}: {response.text}"

    run()
    assert seen, "no request was sent"
    if with_key:
        assert 202 in seen, f"fuzzing never produced a valid record: {seen}"
