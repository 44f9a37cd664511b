"""The console in a real headless browser (Debian's chromium, driven by Playwright) against a
running stack: sign in, create a tenant and see its key once (a Tinker key too), watch the
buffer grow as feedback arrives, roll back a version, read the uPlot charts (time on the x-axis,
values on hover), and prove hostile text is shown, not executed and that the page never asks any
host but the console's own (uPlot is vendored, no CDN).
Screenshots of each page go to test-artifacts/."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from clora.registry import AdapterVersion
from clora.ingest.producer import EventProducer
from clora.ingest.schemas import TOPIC_INTERACTIONS, InteractionEvent

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("CLORA_TEST_ARTIFACTS", "test-artifacts"))
XSS = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script>'


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail("chromium is not installed (dev.py installs it with apt-get: see its setup)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


def keep_on_host(ctx) -> list[str]:
    """Abort every request the browser makes to a host other than 127.0.0.1; returns the list
    the aborted URLs are added to."""
    off_host: list[str] = []

    def route(r):
        if urlsplit(r.request.url).hostname == "127.0.0.1":
            r.continue_()
        else:
            off_host.append(r.request.url)
            r.abort()

    ctx.route("**/*", route)
    return off_host


@pytest.fixture
def page(browser, console):
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    off_host = keep_on_host(ctx)
    p = ctx.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.goto(console.url + "/console/")
    p.fill("#token", console.token)
    p.click("#login-form button")
    p.wait_for_selector("#tenants")
    p.off_host = off_host
    yield p
    ctx.close()
    assert not errors, errors
    assert not off_host, f"the console asked hosts other than its own: {off_host}"


def shot(p, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    p.screenshot(path=str(ARTIFACTS / f"console-{name}.png"), full_page=True)


def legend_labels(p, chart: str) -> list[str]:
    return [t.strip() for t in p.locator(f"{chart} .u-legend .u-series th").all_inner_texts()]


def test_login_is_required(browser, console):
    ctx = browser.new_context()
    p = ctx.new_page()
    p.goto(console.url + "/console/")
    assert p.is_visible("#login") and p.inner_text("#view") == ""
    p.fill("#token", "wrong-token")
    p.click("#login-form button")
    p.wait_for_selector("#login-error:has-text('rejected')")
    shot(p, "login")
    ctx.close()


def test_create_tenant_shows_key_once(page, registry, tenant_id):
    page.fill("#create-tenant input[name=id]", tenant_id)
    page.fill("#create-tenant input[name=name]", "Acme Support")
    page.click("#create-tenant button")
    key = page.wait_for_selector("#shown-key").inner_text()
    assert key.startswith("clk_") and registry.authenticate(key).tenant == tenant_id
    page.wait_for_selector(f"tr[data-tenant='{tenant_id}']")
    shot(page, "overview")
    page.reload()
    page.wait_for_selector(f"tr[data-tenant='{tenant_id}']")
    assert key not in page.content()


def test_the_overview_shows_what_the_supervisor_did(page, redis_client):
    from clora.ingest.reports import ServiceEvent, record_service_event

    detail = f"the embedded broker restarted empty ({time.time_ns()})"
    record_service_event(redis_client, ServiceEvent(time=time.time(), service="broker", kind="data_lost", detail=detail))
    page.reload()
    row = page.wait_for_selector(f"#platform-events tr.alert:has-text('{detail}')")
    assert "broker" in row.inner_text() and row.query_selector(".pill.failing").inner_text() == "data_lost"
    shot(page, "platform-events")


def test_the_overview_shows_a_replica_out_of_rotation_for_an_adapter_and_why(page, registry):
    url = f"http://vllm-{time.time_ns()}.vllm:8000"
    detail = "the adapter answers 0.42 nats/token from the version's canary (tolerance 0.01): another adapter?"
    registry.report_engine("gw-browser", [{"index": 1, "url": url, "kind": "remote", "healthy": True, "restarts": 0,
                                           "in_flight": 0, "resident": ["beta@v1"], "load_failures": {},
                                           "refused": [{"adapter": "acme@v3", "reason": "canary_mismatch",
                                                        "detail": detail, "failures": 1, "retry_in_s": 29.0}]}],
                           stale_s=600)
    page.reload()
    row = page.wait_for_selector(f"#engine tr[data-replica='{url}']")
    pill = row.query_selector(".refused .pill.failing")
    assert pill.inner_text().startswith("acme@v3: canary_mismatch") and pill.get_attribute("title") == detail
    assert "remote" in row.inner_text() and "in rotation" in row.inner_text()
    shot(page, "engine")


def test_feedback_grows_the_buffer(page, stack, registry, webhook, ingest_worker, tenant_id):
    _, key = registry.create_tenant(tenant_id, name="Growth")
    page.goto(page.url.split("#")[0] + f"#/tenant/{tenant_id}")
    page.wait_for_selector("#buffer-depth:has-text('rl 0')")
    producer = EventProducer(stack.kafka_bootstrap)
    for i in range(30):  # enough that some land in training (about 10% are held out)
        registry.claim_interaction(f"{tenant_id}-i{i}", tenant_id)
        ev = InteractionEvent(tenant=tenant_id, interaction_id=f"{tenant_id}-i{i}",
                              messages=[{"role": "user", "content": "hi"}], response={"role": "assistant", "content": "yo"})
        producer.send(TOPIC_INTERACTIONS, tenant_id, ev.model_dump_json())
    producer.flush(10)
    producer.close()
    records = [{"interaction_id": f"{tenant_id}-i{i}", "score": 1.0, "comment": f"ok {i}"} for i in range(30)]
    r = httpx.post(f"{webhook.url}/v1/feedback/batch", headers={"Authorization": f"Bearer {key}"}, json={"records": records})
    assert r.status_code == 202
    page.wait_for_selector("#buffer-depth:not(:has-text('rl 0'))", timeout=30_000)
    page.wait_for_selector("#feedback td.comment:has-text('ok 29')", timeout=10_000)
    page.wait_for_selector("#feedback td.interaction:has-text('hi → yo (base)')", timeout=10_000)
    shot(page, "tenant-feedback")


def test_what_the_guards_did_is_shown_as_an_alert(page, registry, tenant_id):
    from clora.registry import TenantAlert

    registry.create_tenant(tenant_id, name="Hacked")
    reason = f"reward hacking: v3 was rolled back to v2: mean reward 0.917 vs v2's 0.188 ({tenant_id})"
    registry.update_policy(tenant_id, paused=True, paused_reason=reason)
    registry.record_alert(tenant_id, TenantAlert(kind="reward_hacking", detail=reason.removeprefix("reward hacking: "),
                                                 version=3, rolled_back_to=2))
    registry.append_metrics(tenant_id, {"step": 4, "refused": "drift 5.100 nats/token from the base on 16 general "
                                        "prompts exceeds the tenant's tolerance 3.000", "drift": 5.1})
    page.reload()
    alert = page.wait_for_selector(f"#alerts p:has-text('{tenant_id}')")
    assert reason in alert.inner_text()
    row = page.wait_for_selector(f"tr[data-tenant='{tenant_id}']")
    assert {p.inner_text() for p in row.query_selector_all(".pill.failing")} == {"reward hacking", "drift refused"}
    shot(page, "guard-alerts")
    alert.query_selector("a").click()
    assert reason in page.wait_for_selector("#guard-alert").inner_text()
    assert "exceeds the tenant's tolerance 3.000" in page.wait_for_selector("#drift-refusal").inner_text()
    assert "reward hacking: v3 was rolled back to v2" in page.wait_for_selector("#alert-history").inner_text()
    shot(page, "tenant-guard-alert")
    page.click("#pause-toggle")                                # resume: the alert is dealt with
    page.wait_for_selector("#state:has-text('learning')")
    assert page.query_selector("#guard-alert") is None and registry.get_tenant(tenant_id).policy.paused_reason is None


def test_rollback_changes_the_live_version(page, registry, redis_client, tenant_id, request):
    from clora.ingest.buffers import ReplayBuffer
    from clora.ingest.schemas import RLSample

    registry.create_tenant(tenant_id, name="Versions")
    for v in (1, 2, 3):
        guard = {"to": 1, "reason": "mean reward 0.1 over 12 samples vs v1's 0.9 over 30"} if v == 2 else None
        registry.record_adapter_version(tenant_id, AdapterVersion(
            version=v, path=f"/a/{tenant_id}/v{v}", base_model="tiny", parent_version=v - 1 if v > 1 else None,
            step=10 * v, examples_seen=64 * v, eval_scores={"heldout": 0.2 * v}, rolled_back=guard))
        registry.append_metrics(tenant_id, {"step": 10 * v, "loss": 2.0 / v, "reward": 0.3 * v, "eval": 0.2 * v})
    registry.set_live_version(tenant_id, 3)
    registry.append_metrics(tenant_id, {"failed": "FloatingPointError: non-finite gradient", "failures": 2,
                                        "retry_in_s": 10.0})   # the learner's last try failed
    minute = int(time.time() // 60)
    registry.add_traffic({(tenant_id, minute - 2): {"requests": 7, "ok": 5, "latency_s": 2.5, "refused": 2},
                          (tenant_id, minute): {"requests": 3, "ok": 3, "latency_s": 0.6}})
    # Its versions have no folders: left live, they would keep a later test's gateway retrying them.
    request.addfinalizer(lambda: registry.set_live_version(tenant_id, None))
    buffer = ReplayBuffer(redis_client)
    for i, reward in enumerate([1.0, 0.0, 1.0]):   # what v3 served earned, as the ingest worker stores it
        buffer.add_examples(tenant_id, f"f{i}", [RLSample(
            example_id=f"f{i}:rl", tenant=tenant_id, interaction_id=f"i{i}", feedback_event_id=f"f{i}", time=1.0,
            adapter_version=3, messages=[{"role": "user", "content": "q"}], response={"role": "assistant", "content": "a"},
            reward=reward, group_id=f"g{i}")], now=1.0)
    page.goto(page.url.split("#")[0] + "#/")
    assert page.inner_text(f"tr[data-tenant='{tenant_id}'] .rolled-back", timeout=10_000) == "1 rolled back"
    assert page.inner_text(f"tr[data-tenant='{tenant_id}'] td.traffic") == "10"  # the last hour's requests
    failing = page.locator(f"tr[data-tenant='{tenant_id}'] .pill.failing")
    assert failing.inner_text() == "training fails" and "non-finite" in failing.get_attribute("title")
    page.goto(page.url.split("#")[0] + f"#/tenant/{tenant_id}")
    page.wait_for_selector("#live-version:has-text('v3')")
    assert page.inner_text("#training-error") == ("training fails (2 time(s) in a row, next try in 10 s): "
                                                  "FloatingPointError: non-finite gradient")
    assert page.locator("#chart-reward .uplot").count() == 1
    assert page.get_attribute("#chart-reward .chart", "data-points") == "3"   # the failed step has no reward
    assert page.inner_text("tr[data-version='3'] td.served-reward") == "0.67 (3)"
    assert page.get_attribute("#chart-served .chart", "data-points") == "1"   # only v3 served scored answers
    assert legend_labels(page, "#chart-requests") == ["time", "requests", "refused", "errors"]
    assert "last hour: 10" in page.inner_text("#chart-requests")
    assert page.get_attribute("#chart-latency .chart", "data-points") == "2"  # the two minutes that answered
    assert page.inner_text("tr[data-version='1'] td.served-reward") == "—"
    assert page.inner_text("tr[data-version='2'] .rolled-back") == "rolled back to v1 by the reward guard"
    assert page.is_checked("#policy-form input[name=reward_guard]")
    shot(page, "tenant")
    page.click("#rollback")
    page.wait_for_selector("#live-version:has-text('v2')")
    assert registry.live_version(tenant_id) == 2
    page.click("tr[data-version='3'] button.promote")
    page.wait_for_selector("#live-version:has-text('v3')")
    page.click("#pause-toggle")
    page.wait_for_selector("#state:has-text('paused')")
    assert registry.get_tenant(tenant_id).policy.paused
    page.uncheck("#policy-form input[name=reward_guard]")
    page.click("#policy-form button[type=submit]")
    page.wait_for_selector("#policy-msg:has-text('saved')")
    assert registry.get_tenant(tenant_id).policy.reward_guard is False
    page.fill("#policy-form input[name=learning_rate]", "-1")
    page.click("#policy-form button[type=submit]")
    page.wait_for_selector("#policy-msg.error:has-text('learning_rate')")
    shot(page, "tenant-after-rollback")


def test_the_tenant_page_shows_each_versions_feedback_to_served_latency(page, registry, tenant_id, request):
    from clora.freshness import FreshnessSummary, VersionLineage

    registry.create_tenant(tenant_id, name="Fresh")
    lineages = {1: VersionLineage(), 2: VersionLineage(accepted_at={"fb-1": 100.0, "fb-2": 110.0})}  # v1: imported
    for v, lineage in lineages.items():
        registry.record_lineage(tenant_id, v, lineage)
        registry.record_adapter_version(tenant_id, AdapterVersion(
            version=v, path=f"/a/{tenant_id}/v{v}", base_model="tiny", parent_version=v - 1 if v > 1 else None,
            created_at=60.0 * v + 5))
        served = 60.0 * v + 5 + 2.5 * v                                 # v2: 10 s after fb-2, 20 s after fb-1
        registry.claim_first_served(tenant_id, v, served)
        registry.record_freshness(tenant_id, v, FreshnessSummary.of(lineage, served, 60.0 * v + 5))
    registry.set_live_version(tenant_id, 2)
    request.addfinalizer(lambda: registry.set_live_version(tenant_id, None))   # no folders: see above
    page.goto(page.url.split("#")[0] + f"#/tenant/{tenant_id}")
    page.wait_for_selector("#live-version:has-text('v2')")
    assert page.inner_text("#freshness-summary") == "feedback → served: p50 25.0 s, p99 29.9 s over 2 events"
    assert page.inner_text("tr[data-version='2'] td.freshness") == "25.0 / 29.9 s (2)"
    assert page.inner_text("tr[data-version='1'] td.freshness") == "no feedback (2.5 s to serve)"
    # v2's p50 and p99; both versions' publish -> served
    assert page.get_attribute("#freshness .chart", "data-points") == "4"
    shot(page, "tenant-freshness")


def test_the_tenant_page_issues_a_tinker_key_shown_once_and_revokes_it(page, registry, tenant_id):
    registry.create_tenant(tenant_id, name="Research")
    page.goto(page.url.split("#")[0] + f"#/tenant/{tenant_id}")
    page.wait_for_selector("#tinker-keys")
    assert page.locator("#tinker-keys tbody tr").count() == 0
    page.click("#new-tinker-key-btn")
    key = page.wait_for_selector("#shown-tinker-key").inner_text()
    assert key.startswith("tml-") and registry.authenticate_tinker(key).tenant == tenant_id
    key_id = registry.authenticate_tinker(key).key_id
    row = page.wait_for_selector(f"#tinker-keys tr[data-key='{key_id}']")
    assert "active" in row.inner_text()
    shot(page, "tenant-tinker-key")
    page.reload()
    page.wait_for_selector(f"#tinker-keys tr[data-key='{key_id}']")
    assert key not in page.content() and page.query_selector("#shown-tinker-key") is None
    page.click(f"#tinker-keys tr[data-key='{key_id}'] button.revoke-tinker-key")
    page.wait_for_selector(f"#tinker-keys tr[data-key='{key_id}']:has-text('revoked')")
    assert registry.authenticate_tinker(key) is None


def test_the_tenant_page_deletes_the_tenant_once_its_id_is_typed(page, registry, tenant_id):
    from clora.registry import TenantNotFound

    _, key = registry.create_tenant(tenant_id, name="To delete")
    page.goto(page.url.split("#")[0] + f"#/tenant/{tenant_id}")
    button = page.wait_for_selector("#delete-tenant-btn")
    assert button.is_disabled()
    page.fill("#delete-tenant input[name=confirm]", tenant_id[:-1])
    assert button.is_disabled(), "a near miss must not arm the button"
    page.fill("#delete-tenant input[name=confirm]", tenant_id)
    assert button.is_enabled()
    shot(page, "tenant-delete")
    button.click()
    page.wait_for_url(re.compile(r"#/$"))          # back to the overview
    page.wait_for_selector("#tenants")
    assert page.query_selector(f"tr[data-tenant='{tenant_id}']") is None
    with pytest.raises(TenantNotFound):
        registry.get_tenant(tenant_id)
    assert registry.authenticate(key) is None


def test_hostile_text_is_escaped(page, stack, registry, webhook, ingest_worker, tenant_id):
    _, key = registry.create_tenant(tenant_id, name=XSS)
    registry.claim_interaction(f"{tenant_id}-x", tenant_id)
    r = httpx.post(f"{webhook.url}/v1/feedback", headers={"Authorization": f"Bearer {key}"},
                   json={"interaction_id": f"{tenant_id}-x", "comment": XSS,
                         "correction": {"role": "assistant", "content": XSS}})
    assert r.status_code == 202
    page.wait_for_selector(f"tr[data-tenant='{tenant_id}']")
    page.goto(page.url.split("#")[0] + f"#/tenant/{tenant_id}")
    page.wait_for_selector("#feedback td.comment", timeout=30_000)
    time.sleep(0.5)
    assert page.evaluate("window.__xss") is None
    assert page.locator("#feedback td.comment").first.inner_text() == XSS      # shown as text
    assert XSS in page.inner_text("#tenant-title")
    assert page.locator("#view img").count() == 0 and page.locator("#view script").count() == 0
    shot(page, "xss")


TIME_LABEL = re.compile(r"[0-9]{2}:[0-9]{2}(:[0-9]{2})?")


def test_the_charts_are_uplot_with_time_on_the_x_axis_and_values_on_hover(page, registry, tenant_id):
    registry.create_tenant(tenant_id, name="Charts")
    for step, reward in ((10, 0.25), (20, 0.5), (30, 0.75)):
        registry.append_metrics(tenant_id, {"step": step, "loss": 1.0 / step, "reward": reward})
    minute = int(time.time() // 60)
    registry.add_traffic({(tenant_id, minute - 30): {"requests": 4, "ok": 4, "latency_s": 2.0},
                          (tenant_id, minute): {"requests": 2, "ok": 1, "latency_s": 0.5, "errors": 1}})
    page.goto(page.url.split("#")[0] + f"#/tenant/{tenant_id}")
    for chart in ("#chart-reward", "#chart-loss", "#chart-eval", "#chart-served", "#chart-requests",
                  "#chart-latency", "#freshness"):
        page.wait_for_selector(f"{chart} .uplot canvas")
    assert page.locator("#view svg").count() == 0                       # no hand-drawn charts left
    for chart in ("#chart-reward", "#chart-requests"):
        labels = page.get_attribute(f"{chart} .chart", "data-x-labels").split()
        assert labels and all(TIME_LABEL.fullmatch(x) for x in labels), labels
    # the hour of traffic: minutes, the three seconds of learner steps: seconds
    assert all(len(x) == 5 for x in page.get_attribute("#chart-requests .chart", "data-x-labels").split())
    value = page.locator("#chart-reward .u-legend .u-series").nth(1).locator(".u-value")
    assert value.inner_text() in ("—", "--")                            # no cursor yet: no value
    box = page.locator("#chart-reward .u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_function("""() => /^[0-9.]+$/.test(document.querySelector(
        "#chart-reward .u-legend .u-series:nth-child(2) .u-value").textContent)""")
    assert value.inner_text() in ("0.250", "0.500", "0.750")
    when = page.locator("#chart-reward .u-legend .u-series").nth(0).locator(".u-value").inner_text()
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2} \(step [123]0\)", when), when
    page.mouse.move(box["x"] + box["width"] - 2, box["y"] + box["height"] / 2)   # the latest step
    page.wait_for_function("""() => document.querySelector(
        "#chart-reward .u-legend .u-series:nth-child(2) .u-value").textContent === "0.750" """)
    # the next refresh (every 2 s) keeps the chart and the hovered value
    page.wait_for_function("""() => document.getElementById("status").textContent.startsWith("updated")""")
    first = page.inner_text("#status")
    page.wait_for_function(f"""() => document.getElementById("status").textContent !== {first!r}""", timeout=10_000)
    assert page.locator("#chart-reward .uplot").count() == 1 and value.inner_text() == "0.750"
    # the legends sit under their plots, side by side with the other charts' and not over them
    plots = [page.locator(f"{c} .uplot").bounding_box() for c in ("#chart-reward", "#chart-loss")]
    legend = page.locator("#chart-reward .u-legend").bounding_box()
    over = page.locator("#chart-reward .u-over").bounding_box()
    assert legend["y"] >= over["y"] + over["height"] - 1
    assert plots[0]["x"] + plots[0]["width"] <= plots[1]["x"] or plots[0]["y"] + plots[0]["height"] <= plots[1]["y"]
    shot(page, "tenant-charts")
    assert page.off_host == []


def test_the_console_never_asks_another_host(browser, console):
    ctx = browser.new_context()
    off_host = keep_on_host(ctx)
    asked: list[str] = []
    ctx.on("request", lambda r: asked.append(r.url))
    p = ctx.new_page()
    p.goto(console.url + "/console/")
    p.fill("#token", console.token)
    p.click("#login-form button")
    p.wait_for_selector("#tenants")
    p.wait_for_function("() => window.uPlot !== undefined")
    ctx.close()
    assert any(u.endswith("/static/vendor/uplot/uPlot.iife.min.js") for u in asked), asked
    assert any(u.endswith("/static/vendor/uplot/uPlot.min.css") for u in asked), asked
    assert off_host == [] and all(urlsplit(u).hostname == "127.0.0.1" for u in asked), asked


def test_the_control_api_answers_unknown_routes_and_wrong_methods_in_its_envelope(console):
    auth = {"Authorization": f"Bearer {console.token}"}
    r = httpx.get(f"{console.url}/api/nowhere", headers=auth)
    assert r.status_code == 404 and r.json() == {"error": {
        "code": "not_found", "message": "GET /api/nowhere: no such route or file", "field": "path"}}
    r = httpx.delete(f"{console.url}/api/tenants", headers=auth)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed" and "allow" in r.headers
    r = httpx.get(f"{console.url}/static/vendor/uplot/missing.js")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.post(f"{console.url}/api/tenants", headers=auth, json={"id": 7})
    assert r.status_code == 422 and r.json()["error"]["field"] == "id" and "detail" not in r.json()
