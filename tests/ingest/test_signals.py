"""What served replies say about their version: each reply's traits, and the per-version
signals the ingest worker keeps in Redis (counted once per interaction, in the same script
that stores it)."""

from __future__ import annotations

import time

import pytest

from clora.ingest.buffers import BufferPolicy, ReplayBuffer
from clora.ingest.schemas import InteractionEvent
from clora.ingest.signals import DIVERSITY_WINDOW, ReplyTraits, ServedSignals


def served(tenant: str, i: int, version: int | None, content: str | None = None, calls: list[str] = (),
           interaction_id: str | None = None, prompt: str | None = None) -> InteractionEvent:
    """Interaction `i` of `tenant`, answered by `version` with `content` and tool calls whose
    arguments are `calls`."""
    tool_calls = [{"id": f"c{k}", "function": {"name": "calculator", "arguments": a}} for k, a in enumerate(calls)]
    return InteractionEvent(tenant=tenant, interaction_id=interaction_id or f"i{i}", adapter_version=version,
                            messages=[{"role": "user", "content": prompt or f"q{i}"}],
                            response={"role": "assistant", "content": content, "tool_calls": tool_calls or None})


def test_a_replys_traits():
    blank = ReplyTraits.of(served("t", 1, 3, "  \n "))
    assert blank.version == 3 and blank.empty and not blank.tool_call and blank.length == 4
    call = ReplyTraits.of(served("t", 2, None, None, ['{"expression": "17*3"}']))
    assert not call.empty and call.tool_call and not call.bad_tool_call and call.version is None
    assert call.length == len("calculator") + len('{"expression": "17*3"}')
    for broken in ('{"expression": "17*3"', '"17*3"', ""):          # cut short; not an object; nothing
        assert ReplyTraits.of(served("t", 3, 1, None, [broken])).bad_tool_call, broken
    # the fingerprint ignores case and spacing, and nothing else
    same = {ReplyTraits.of(served("t", k, 1, text)).fingerprint for k, text in enumerate(["Hi  there", "hi there\n"])}
    assert len(same) == 1 and ReplyTraits.of(served("t", 4, 1, "hi where")).fingerprint not in same


def test_served_signals_rates():
    s = ServedSignals(n=40, empty=2, tool_calls=30, bad_tool_calls=1, chars=2400, chars_sq=180_000, distinct=38)
    assert (s.empty_rate, s.bad_tool_call_rate, s.mean_length, s.diversity) == (0.05, 0.025, 60.0, 0.95)
    assert s.length_variance == pytest.approx((180_000 - 2400 ** 2 / 40) / 39)
    # diversity counts the first DIVERSITY_WINDOW replies only
    assert ServedSignals(n=1000, empty=0, tool_calls=0, bad_tool_calls=0, chars=0, chars_sq=0,
                         distinct=DIVERSITY_WINDOW // 2).diversity == 0.5


@pytest.mark.integration
def test_the_worker_script_counts_each_interaction_once_at_its_version(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    replies = [served(tenant_id, 1, 2, "Paris."), served(tenant_id, 2, 2, "paris. "), served(tenant_id, 3, 2, ""),
               served(tenant_id, 4, 2, None, ['{"x": 1']), served(tenant_id, 5, None, "hello"),
               served(tenant_id, 6, 3, "ok")]
    for _ in range(2):   # a redelivered interaction counts once
        batch = buf.batch()
        for ix in replies:
            batch.store_interaction(tenant_id, ix.event_id, ix.interaction_id, ix.model_dump_json(), now=time.time(),
                                    traits=ReplyTraits.of(ix))
        batch.execute()
    signals = buf.served_signals(tenant_id)
    assert set(signals) == {2, 3, None}
    v2 = signals[2]
    assert (v2.n, v2.empty, v2.tool_calls, v2.bad_tool_calls, v2.distinct) == (4, 1, 1, 1, 3)
    lengths = [6, 7, 0, len("calculator") + len('{"x": 1')]
    assert (v2.chars, v2.chars_sq) == (sum(lengths), sum(n * n for n in lengths))
    assert signals[None].n == 1 and signals[3].mean_length == 2.0
    # an interaction stored without traits (an older caller) counts nothing
    ix = served(tenant_id, 7, 2, "again")
    buf.store_interaction(tenant_id, ix.event_id, ix.interaction_id, ix.model_dump_json(), now=time.time())
    assert buf.served_signals(tenant_id)[2].n == 4


@pytest.mark.integration
def test_diversity_is_counted_over_a_versions_first_replies(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    for i in range(DIVERSITY_WINDOW + 20):      # all different, but only the first window counts
        ix = served(tenant_id, i, 1, f"answer {i}")
        buf.store_interaction(tenant_id, ix.event_id, ix.interaction_id, ix.model_dump_json(), now=time.time(),
                              traits=ReplyTraits.of(ix))
    s = buf.served_signals(tenant_id)[1]
    assert s.n == DIVERSITY_WINDOW + 20 and s.distinct == DIVERSITY_WINDOW and s.diversity == 1.0


def test_diversity_is_per_distinct_prompt_when_prompts_are_recorded():
    prompt = {ReplyTraits.of(served("t", k, 1, "x", prompt=p)).prompt_fingerprint for k, p in enumerate(["Hi  A", "hi a"])}
    assert len(prompt) == 1 and ReplyTraits.of(served("t", 3, 1, "x", prompt="hi b")).prompt_fingerprint not in prompt
    # 4 prompts, 8 episodes each, one answer per prompt: each prompt answered its own way
    assert ServedSignals(n=32, empty=0, tool_calls=0, bad_tool_calls=0, chars=0, chars_sq=0, distinct=4,
                         prompts=4).diversity == 1.0
    assert ServedSignals(n=32, empty=0, tool_calls=0, bad_tool_calls=0, chars=0, chars_sq=0, distinct=1,
                         prompts=4).diversity == 0.25


@pytest.mark.integration
def test_the_worker_script_counts_each_versions_prompts(redis_client, tenant_id):
    """Groups of episodes on the same prompts: the converged version's answers are one per
    prompt (diversity 1.0); one answer to every prompt is 1 per 4."""
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    batch = buf.batch()
    for i in range(32):
        prompt = f"what is {i % 4} + 1?"
        for version, answer in ((1, f"{i % 4 + 1}"), (2, "42")):
            ix = served(tenant_id, i, version, answer, prompt=prompt, interaction_id=f"i{i}-v{version}")
            batch.store_interaction(tenant_id, ix.event_id, ix.interaction_id, ix.model_dump_json(), now=time.time(),
                                    traits=ReplyTraits.of(ix))
    batch.execute()
    signals = buf.served_signals(tenant_id)
    assert (signals[1].n, signals[1].distinct, signals[1].prompts, signals[1].diversity) == (32, 4, 4, 1.0)
    assert (signals[2].distinct, signals[2].prompts, signals[2].diversity) == (1, 4, 0.25)
