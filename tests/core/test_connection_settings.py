"""How clora's clients connect to a managed Kafka and Redis: `KafkaSettings` turns TLS and SASL
settings into the arguments every kafka-python client takes, and refuses a combination that
cannot work naming the variable; Redis URLs (TLS, passwords, a private CA) reach redis-py as
given; a password never reaches a log line. Unit tests: nothing connects."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from clora.settings import KafkaSettings, kafka_client_kwargs, librdkafka_config, redacted_url

SASL = {"CLORA_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "CLORA_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "CLORA_KAFKA_SASL_USERNAME": "clora", "CLORA_KAFKA_SASL_PASSWORD": "s3cret"}


def _env(monkeypatch, values: dict[str, str]) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_plaintext_by_default_with_one_replica(monkeypatch):
    for name in ("SECURITY_PROTOCOL", "SASL_MECHANISM", "SASL_USERNAME", "SASL_PASSWORD", "SSL_CAFILE",
                 "SSL_CERTFILE", "SSL_KEYFILE", "REPLICATION_FACTOR", "MIN_INSYNC_REPLICAS"):
        monkeypatch.delenv(f"CLORA_KAFKA_{name}", raising=False)
    assert kafka_client_kwargs() == {"security_protocol": "PLAINTEXT"}
    s = KafkaSettings()
    assert (s.replication_factor, s.min_insync_replicas) == (1, 1)


def test_sasl_over_tls_from_the_environment(monkeypatch, tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    _env(monkeypatch, SASL | {"CLORA_KAFKA_SSL_CAFILE": str(ca)})
    assert kafka_client_kwargs() == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "clora",
        "sasl_plain_password": "s3cret", "ssl_cafile": str(ca)}
    assert "s3cret" not in repr(KafkaSettings())


def test_mutual_tls_passes_the_client_certificate_and_key(tmp_path):
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    cert.write_text("cert")
    key.write_text("key")
    kwargs = kafka_client_kwargs(KafkaSettings(security_protocol="SSL", ssl_certfile=cert, ssl_keyfile=key))
    assert kwargs == {"security_protocol": "SSL", "ssl_certfile": str(cert), "ssl_keyfile": str(key)}


def test_every_kafka_client_accepts_the_arguments(tmp_path):
    """The names match kafka-python's own configuration keys, for the producer, the consumer and
    the admin client alike (a misspelled one would raise when the client is built)."""
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

    cert = tmp_path / "client.pem"
    cert.write_text("cert")
    kwargs = kafka_client_kwargs(KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
                                               sasl_username="u", sasl_password="p", ssl_cafile=cert,
                                               ssl_certfile=cert, ssl_keyfile=cert))
    for client in (KafkaProducer, KafkaConsumer, KafkaAdminClient):
        assert set(kwargs) <= set(client.DEFAULT_CONFIG), client.__name__


def test_the_producer_gets_the_same_settings_under_librdkafkas_names(tmp_path):
    """`EventProducer` is librdkafka's: the same TLS and SASL settings reach it under its own
    keys, and a producer built with them accepts every key (a misspelled one raises)."""
    from confluent_kafka import Producer

    cert = tmp_path / "client.pem"
    cert.write_text("cert")
    settings = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="u",
                             sasl_password="p", ssl_cafile=cert, ssl_certfile=cert, ssl_keyfile=cert)
    config = librdkafka_config(settings)
    assert config == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "u",
                      "sasl.password": "p", "ssl.ca.location": str(cert), "ssl.certificate.location": str(cert),
                      "ssl.key.location": str(cert)}
    assert librdkafka_config(KafkaSettings()) == {"security.protocol": "PLAINTEXT"}
    Producer({"bootstrap.servers": "127.0.0.1:1", **librdkafka_config(KafkaSettings(security_protocol="SASL_PLAINTEXT",
              sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p"))})


@pytest.mark.parametrize("env, error", [
    ({"CLORA_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"},
     "needs CLORA_KAFKA_SASL_MECHANISM, CLORA_KAFKA_SASL_USERNAME, CLORA_KAFKA_SASL_PASSWORD"),
    ({**SASL, "CLORA_KAFKA_SASL_PASSWORD": ""}, "needs CLORA_KAFKA_SASL_PASSWORD"),
    ({"CLORA_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "CLORA_KAFKA_SASL_MECHANISM": "PLAIN",
      "CLORA_KAFKA_SASL_PASSWORD": "p"}, "needs CLORA_KAFKA_SASL_USERNAME"),
    ({"CLORA_KAFKA_SECURITY_PROTOCOL": "SSL", "CLORA_KAFKA_SSL_CAFILE": "/nonexistent/ca.pem"},
     "CLORA_KAFKA_SSL_CAFILE=/nonexistent/ca.pem: no such file"),
    ({"CLORA_KAFKA_SASL_USERNAME": "clora"}, "CLORA_KAFKA_SASL_USERNAME set, but CLORA_KAFKA_SECURITY_PROTOCOL"
     "=PLAINTEXT does not use SASL"),
    ({"CLORA_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", **{k: v for k, v in SASL.items() if "PROTOCOL" not in k},
      "CLORA_KAFKA_SSL_CAFILE": "/etc/hosts"}, "CLORA_KAFKA_SSL_CAFILE set, but CLORA_KAFKA_SECURITY_PROTOCOL"
     "=SASL_PLAINTEXT does not use TLS"),
    ({"CLORA_KAFKA_SECURITY_PROTOCOL": "SSL", "CLORA_KAFKA_SSL_KEYFILE": "/etc/hosts"},
     "CLORA_KAFKA_SSL_KEYFILE is set without CLORA_KAFKA_SSL_CERTFILE"),
    ({"CLORA_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "CLORA_KAFKA_SASL_MECHANISM": "GSSAPI"}, "sasl_mechanism"),
    ({"CLORA_KAFKA_REPLICATION_FACTOR": "1", "CLORA_KAFKA_MIN_INSYNC_REPLICAS": "2"},
     r"CLORA_KAFKA_MIN_INSYNC_REPLICAS \(2\) must not exceed CLORA_KAFKA_REPLICATION_FACTOR \(1\)"),
])
def test_a_combination_that_cannot_work_is_refused_naming_the_variable(monkeypatch, env, error):
    _env(monkeypatch, env)
    with pytest.raises(ValidationError, match=error):
        kafka_client_kwargs()


def test_the_embedded_broker_refuses_a_secured_protocol_before_starting(monkeypatch, tmp_path):
    from clora.infra.stack import LocalStack
    from clora.settings import PlatformSettings

    _env(monkeypatch, SASL)
    stack = LocalStack(platform=PlatformSettings(data_dir=tmp_path, kafka_bootstrap=None, redis_url=None))
    with pytest.raises(ValueError, match="SASL_SSL needs an external Kafka"):
        stack.start()
    assert stack.processes == {}


def test_redis_urls_reach_redis_py_as_given():
    """TLS (`rediss://`), a user and password, and a private CA in the query all reach the
    connection pool of the sync and the asyncio clients every clora service builds."""
    import redis
    import redis.asyncio

    from clora.ingest.webhook import async_redis_client

    url = "rediss://clora:s3cret@redis.internal:6380/2?ssl_ca_certs=/etc/clora/redis-ca.pem&ssl_cert_reqs=required"
    for client in (redis.Redis.from_url(url), async_redis_client(url)):
        pool = client.connection_pool
        assert pool.connection_class.__name__ == "SSLConnection"
        kw = pool.connection_kwargs
        assert (kw["host"], kw["port"], kw["db"]) == ("redis.internal", 6380, 2)
        assert (kw["username"], kw["password"]) == ("clora", "s3cret")
        assert (kw["ssl_ca_certs"], kw["ssl_cert_reqs"]) == ("/etc/clora/redis-ca.pem", "required")


@pytest.mark.parametrize("url, shown", [
    ("rediss://:s3cret@redis:6380/0", "rediss://:***@redis:6380/0"),
    ("redis://clora:s3cret@redis:6379/0?ssl_ca_certs=/ca.pem", "redis://clora:***@redis:6379/0?ssl_ca_certs=/ca.pem"),
    ("redis://127.0.0.1:16379/0", "redis://127.0.0.1:16379/0"),
])
def test_a_url_in_a_log_line_hides_its_password(url, shown):
    assert redacted_url(url) == shown
