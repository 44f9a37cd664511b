"""The prefix-cache salt key is shared by every gateway on one Redis (the real one the suite
starts), so a tenant's cached prefixes serve it through any gateway, and still differ per tenant."""

import redis

from clora.serving.gateway import SALT_KEY, Gateway, shared_salt_key


def test_gateways_on_one_redis_share_the_salt_key_and_tenants_still_differ(stack):
    r = redis.Redis.from_url(stack.redis_url)
    r.delete(SALT_KEY)
    first, second = shared_salt_key(r), shared_salt_key(redis.Redis.from_url(stack.redis_url))
    assert first == second and len(first) == 32
    salt = lambda key, tenant: Gateway.cache_salt(type("G", (), {"salt_key": key})(), tenant)  # noqa: E731
    assert salt(first, "acme") == salt(second, "acme") != salt(first, "globex")
    r.delete(SALT_KEY)
    assert shared_salt_key(r) != first           # a new deployment's key is its own
