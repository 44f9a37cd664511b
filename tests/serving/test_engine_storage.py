"""The engine manager with an S3-compatible adapter store (moto in server mode, the suite's `s3`
fixture) against a fake vLLM (httpx mock transport): a version is fetched into this host's
cache and verified before vLLM is asked to load it, and vLLM is given the cached folder."""

from __future__ import annotations

import asyncio
import json
import os

import boto3
import httpx
import pytest

from clora.serving.aliases import AdapterRef
from clora.serving.engine import AdapterLoadError, EngineManager
from clora.serving.settings import EngineSettings
from clora.storage import S3Storage
from tests.serving.gateway_harness import canary_request, canary_response

pytestmark = pytest.mark.integration

FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": os.urandom(50_000)}


def _engine(tmp_path, storage, loads: list) -> EngineManager:
    def handler(request: httpx.Request) -> httpx.Response:
        if (canary := canary_request(request)) is not None:
            return canary_response(canary)
        if request.url.path == "/v1/load_lora_adapter":
            loads.append(json.loads(request.read()))
        return httpx.Response(200, text="ok")

    es = EngineSettings(model=str(tmp_path), ports=[1], max_loras=1, max_cpu_loras=4, base_via_zero_adapter=False,
                        log_dir=tmp_path)
    eng = EngineManager(es, adapter_wait_s=0.5, storage=storage)
    eng.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    for r in eng.replicas:
        r.healthy = True
    return eng


def _publish(settings, tmp_path, tenant: str, version: int) -> str:
    folder = tmp_path / "learner" / tenant / f".tmp-v{version}"
    folder.mkdir(parents=True)
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
    return S3Storage(settings, tmp_path / "learner").publish(tenant, version, folder)


def test_vllm_loads_the_verified_cached_folder_not_the_store_uri(s3_storage_settings, tmp_path):
    uri = _publish(s3_storage_settings, tmp_path, "acme", 3)
    cache = S3Storage(s3_storage_settings, tmp_path / "serving-cache")

    async def run():
        loads: list = []
        eng = _engine(tmp_path, cache, loads)
        async with eng.lease(AdapterRef("acme", 3, uri)) as lease:
            assert lease.model == "acme@v3"
        await eng.preload(AdapterRef("acme", 3, uri))           # resident already: no second load
        await eng.http.aclose()
        return loads

    loads = asyncio.run(run())
    folder = tmp_path / "serving-cache" / "acme" / "v3"
    assert loads == [{"lora_name": "acme@v3", "lora_path": str(folder)}]
    assert {n: (folder / n).read_bytes() for n in FILES} == FILES


def test_a_corrupt_version_is_never_handed_to_vllm(s3_storage_settings, tmp_path):
    uri = _publish(s3_storage_settings, tmp_path, "acme", 1)
    boto3.client("s3", endpoint_url=s3_storage_settings.s3_endpoint_url, region_name="us-east-1",
                 aws_access_key_id="test", aws_secret_access_key="test").put_object(
        Bucket=s3_storage_settings.s3_bucket, Key="adapters/acme/v1/adapter_model.safetensors", Body=b"garbage")

    async def run():
        loads: list = []
        eng = _engine(tmp_path, S3Storage(s3_storage_settings, tmp_path / "serving-cache"), loads)
        with pytest.raises(AdapterLoadError, match="acme@v1.*has 7 bytes") as e:
            await eng.preload(AdapterRef("acme", 1, uri))
        await eng.http.aclose()
        return loads, e.value

    loads, error = asyncio.run(run())
    assert loads == [] and not error.transient          # hot swap backs off instead of retrying every poll
    assert not (tmp_path / "serving-cache" / "acme" / "v1").exists()
