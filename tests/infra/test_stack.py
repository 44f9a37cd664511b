"""The embedded stack: it starts the real broker and Redis, and starts nothing when given
external URLs."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.integration


def test_stack_services_answer(stack, redis_client):
    from kafka import KafkaAdminClient

    assert redis_client.ping()
    assert redis_client.config_get("appendonly")["appendonly"] == "yes"
    admin = KafkaAdminClient(bootstrap_servers=stack.kafka_bootstrap)
    assert {"clora.feedback", "clora.interactions", "clora.dlq", "clora.adapters"} <= set(admin.list_topics())
    admin.close()
    assert all(p.exists() for p in stack.log_paths().values())


def test_external_urls_start_nothing(tmp_path, stack):
    from clora.settings import PlatformSettings
    from clora.infra.stack import LocalStack

    ext = LocalStack(platform=PlatformSettings(data_dir=tmp_path, kafka_bootstrap=stack.kafka_bootstrap,
                                               redis_url=stack.redis_url))
    with ext:
        assert ext.processes == {}
        assert ext.kafka_bootstrap == stack.kafka_bootstrap and ext.redis_url == stack.redis_url
    assert not (tmp_path / "logs").exists()


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="the kernel lists no /proc/<pid>/task/<pid>/children (CONFIG_PROC_CHILDREN)")
def test_redis_aof_rewrites_run_at_the_lowest_cpu_priority_and_redis_at_its_own(tmp_path, stack, wait_for):
    """A rewrite copies the whole dataset with a core busy for seconds: at Redis's priority it
    held the ingest path back on a small shared machine."""
    import os

    import redis

    from clora.infra.settings import RedisSettings
    from clora.infra.stack import LocalStack
    from clora.procs import free_port
    from clora.settings import PlatformSettings

    def children(pid: int) -> list[int]:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]

    lone = LocalStack(platform=PlatformSettings(data_dir=tmp_path, kafka_bootstrap=stack.kafka_bootstrap),
                      redis=RedisSettings(port=free_port()))
    with lone:
        r = redis.Redis.from_url(lone.redis_url)
        r.mset({f"k{i}": "v" for i in range(100)})
        r.config_set("rdb-key-save-delay", 100_000)        # 0.1 s a key: the rewrite's child lives for seconds
        r.bgrewriteaof()
        pid = lone.processes["redis"].pid
        child = wait_for(lambda: children(pid), what="the AOF rewrite's child")[0]
        wait_for(lambda: os.getpriority(os.PRIO_PROCESS, child) == 19, what="the rewrite's child at niceness 19")
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)
        r.config_set("rdb-key-save-delay", 0)
        wait_for(lambda: r.info("persistence")["aof_rewrite_in_progress"] == 0, what="the rewrite's end")
        assert r.get("k99") == b"v"
        r.close()
