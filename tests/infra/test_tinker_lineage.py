"""A Tinker training run's sampler weights in the console's lineage: the control API's versions
list says where each version came from (`source`, `tinker_path`), and the versions table marks
those that came from the Tinker API with their path."""

from __future__ import annotations

import httpx
import pytest

from clora.registry import AdapterVersion
from tests.infra.test_console_browser import browser, page, shot  # noqa: F401 - the signed-in console page

pytestmark = pytest.mark.integration

PATH = "tinker://9f2c:train:0/sampler_weights/final"


def _lineage(registry, tenant_id) -> None:
    """v1 the learner's (live), v2 a named Tinker save, v3 an unnamed one (an RL step's)."""
    registry.create_tenant(tenant_id)
    registry.record_adapter_version(tenant_id, AdapterVersion(version=1, path=f"/a/{tenant_id}/v1", base_model="tiny"))
    registry.record_adapter_version(tenant_id, AdapterVersion(version=2, path=f"/a/{tenant_id}/v2", base_model="tiny",
                                                              step=12, source="tinker", tinker_path=PATH))
    registry.record_adapter_version(tenant_id, AdapterVersion(version=3, path=f"/a/{tenant_id}/v3", base_model="tiny",
                                                              step=13, source="tinker"))
    registry.set_live_version(tenant_id, 1)


def test_the_versions_api_says_which_versions_came_from_the_tinker_api(console, registry, tenant_id, request):
    _lineage(registry, tenant_id)
    request.addfinalizer(lambda: registry.set_live_version(tenant_id, None))   # no folders to serve
    listed = httpx.get(f"{console.url}/api/tenants/{tenant_id}/versions",
                       headers={"Authorization": f"Bearer {console.token}"}).json()
    assert listed["live"] == 1
    assert [(v["version"], v["source"], v["tinker_path"]) for v in listed["versions"]] == \
        [(1, None, None), (2, "tinker", PATH), (3, "tinker", None)]


def test_the_versions_table_marks_tinker_versions_with_their_path(page, registry, tenant_id, request):  # noqa: F811
    _lineage(registry, tenant_id)
    request.addfinalizer(lambda: registry.set_live_version(tenant_id, None))
    page.goto(page.url.split("#")[0] + f"#/tenant/{tenant_id}")
    page.wait_for_selector("#versions tr[data-version='3']")
    assert page.locator("tr[data-version='1'] .tinker").count() == 0
    assert page.inner_text("tr[data-version='2'] .tinker") == f"from the Tinker API\n{PATH}"
    assert "unnamed sampler" in page.inner_text("tr[data-version='3'] .tinker")
    shot(page, "tenant-tinker-lineage")
