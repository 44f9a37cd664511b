"""Settings come from the environment: the platform's under `CLORA_`, each service's under
`CLORA_<SERVICE>_` (`settings_config`), and a bad value fails naming its field."""

from __future__ import annotations

import pytest


def test_settings_come_from_the_environment(monkeypatch):
    from pydantic import ValidationError

    from clora.ingest.settings import IngestSettings, WebhookSettings
    from clora.settings import PlatformSettings

    monkeypatch.setenv("CLORA_KAFKA_BOOTSTRAP", "kafka:9092")
    monkeypatch.setenv("CLORA_WEBHOOK_MAX_BATCH", "7")
    assert PlatformSettings().kafka_bootstrap == "kafka:9092"
    assert WebhookSettings().max_batch == 7
    monkeypatch.setenv("CLORA_INGEST_EVICTION", "lru")
    with pytest.raises(ValidationError, match="eviction"):
        IngestSettings()
