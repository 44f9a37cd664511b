"""Replay buffers on the real Redis: at-most-once storage, capacity and eviction, the join of
feedback that arrives first, sampling that mixes fresh and older data, and AOF durability."""

from __future__ import annotations

import statistics
import time

import pytest

from clora.ingest.buffers import BufferPolicy, ParkResult, PendingWrite, ReplayBuffer, is_heldout
from clora.ingest.schemas import RLSample, SFTExample

pytestmark = pytest.mark.integration


def sft(tenant: str, i: int) -> SFTExample:
    return SFTExample(example_id=f"fb{i}:sft", tenant=tenant, interaction_id=f"i{i}", feedback_event_id=f"fb{i}",
                      time=time.time(), messages=[{"role": "user", "content": f"q{i}"}],
                      target={"role": "assistant", "content": f"a{i}"})


def fill(buf: ReplayBuffer, tenant: str, ids) -> None:
    for i in ids:
        buf.add_examples(tenant, f"fb{i}", [sft(tenant, i)], now=time.time())


def train_ids(buf, tenant):
    return [int(e.interaction_id[1:]) for e in buf.latest(tenant, "sft", 10_000)]


def test_redelivered_event_is_stored_once(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    assert buf.add_examples(tenant_id, "fb1", [sft(tenant_id, 1)], now=time.time()) == 1
    assert buf.add_examples(tenant_id, "fb1", [sft(tenant_id, 1)], now=time.time()) == 0
    assert buf.depth(tenant_id, "sft") == 1
    assert buf.stats(tenant_id) == {"added": 1, "duplicates": 1}


def test_fifo_eviction_keeps_the_newest(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client, BufferPolicy(capacity=5, holdout_fraction=0.0))
    fill(buf, tenant_id, range(12))
    assert sorted(train_ids(buf, tenant_id)) == [7, 8, 9, 10, 11]
    assert buf.stats(tenant_id)["evicted"] == 7


def test_random_eviction_respects_capacity(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client, BufferPolicy(capacity=20, eviction="random", holdout_fraction=0.0))
    fill(buf, tenant_id, range(60))
    kept = train_ids(buf, tenant_id)
    assert len(kept) == 20 and 59 in kept          # the newest is never the victim of its own insert
    assert buf.stats(tenant_id)["evicted"] == 40
    # Not FIFO. Random eviction keeps exactly the newest 20 only if each of the last 19 inserts
    # evicts an older survivor: (1/20)(2/20)...(19/20) = 19!/20^19 ~ 2e-8. (With capacity 5 that
    # is 4!/5^4 ~ 4%, and stop 14's CI drew it.)
    assert sorted(kept) != list(range(40, 60))


def test_sampling_mixes_fresh_and_old_and_advances_cursor(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    fill(buf, tenant_id, range(10))
    first = buf.sample(tenant_id, "sft", 4, cursor=0, seed=1)
    assert first.fresh == 4                       # nothing is old yet: fresh fills the batch
    assert [e.interaction_id for e in first.examples] == ["i0", "i1", "i2", "i3"]
    second = buf.sample(tenant_id, "sft", 4, cursor=first.cursor, fresh_fraction=0.5, seed=2)
    ids = [int(e.interaction_id[1:]) for e in second.examples]
    assert ids[:2] == [4, 5] and all(i < 4 for i in ids[2:]) and len(set(ids)) == 4
    assert buf.newer_than(tenant_id, "sft", second.cursor) == 4
    assert buf.sample(tenant_id, "sft", 20, cursor=second.cursor).fresh == 4


def test_on_policy_sampling_takes_only_examples_past_the_cursor(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    fill(buf, tenant_id, range(10))
    first = buf.sample(tenant_id, "sft", 6, fresh_fraction=1.0, fill=False)
    assert [e.interaction_id for e in first.examples] == [f"i{i}" for i in range(6)]
    # 4 left past the cursor: a batch of 8 is those 4, not topped up with older ones
    second = buf.sample(tenant_id, "sft", 8, cursor=first.cursor, fresh_fraction=1.0, fill=False, seed=3)
    assert [e.interaction_id for e in second.examples] == ["i6", "i7", "i8", "i9"] and second.fresh == 4
    assert buf.sample(tenant_id, "sft", 8, cursor=second.cursor, fresh_fraction=1.0, fill=False).examples == []
    # the default still fills: the same call with fill=True tops up from older data
    assert len(buf.sample(tenant_id, "sft", 8, cursor=first.cursor, fresh_fraction=1.0, seed=3).examples) == 8


def test_rl_samples_are_held_out_by_group(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.3))
    for g in range(40):
        for i in range(4):
            n = g * 4 + i
            buf.add_examples(tenant_id, f"fb{n}", [RLSample(
                example_id=f"fb{n}:rl", tenant=tenant_id, interaction_id=f"i{n}", feedback_event_id=f"fb{n}",
                time=time.time(), messages=[{"role": "user", "content": f"q{g}"}],
                response={"role": "assistant", "content": f"a{n}"}, reward=float(i), group_id=f"g{g}")],
                now=time.time())
    held = [e.group_id for e in buf.heldout(tenant_id, "rl")]
    train = [e.group_id for e in buf.latest(tenant_id, "rl", 1000)]
    assert held and train and not set(held) & set(train)            # no group is split
    assert all(held.count(g) == 4 for g in held) and all(train.count(g) == 4 for g in train)


def _rl(tenant: str, n: int, reward: float, version: int | None, group: str = "",
        episode: str | None = None) -> RLSample:
    return RLSample(example_id=f"fb{n}:rl", tenant=tenant, interaction_id=f"i{n}", feedback_event_id=f"fb{n}",
                    time=time.time(), messages=[{"role": "user", "content": f"q{n}"}], adapter_version=version,
                    response={"role": "assistant", "content": f"a{n}"}, reward=reward, group_id=group or f"g{n}",
                    episode_id=episode)


def test_rewards_are_tallied_per_serving_version_once_per_sample(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.3, capacity=3))
    rewards = {None: [0.0, 0.0, 1.0], 1: [1.0, 1.0, 0.0, 1.0], 2: [0.25, -0.5]}
    n = 0
    for version, rs in rewards.items():
        for r in rs:
            n += 1
            buf.add_examples(tenant_id, f"fb{n}", [_rl(tenant_id, n, r, version), sft(tenant_id, n)], now=time.time())
    buf.add_examples(tenant_id, "fb1", [_rl(tenant_id, 1, 0.0, None)], now=time.time())        # redelivered
    buf.add_many(tenant_id, [PendingWrite("fb99", [_rl(tenant_id, 99, 1.0, 2)]),              # one call, two
                             PendingWrite("fb98", [_rl(tenant_id, 98, 0.5, 2)])], now=time.time())  # events
    rewards[2] += [1.0, 0.5]
    tallies = buf.version_rewards(tenant_id)
    assert set(tallies) == {None, 1, 2}
    for version, rs in rewards.items():   # held-out and evicted samples (capacity 3) count too
        t = tallies[version]
        assert t.n == len(rs)
        assert t.mean == pytest.approx(statistics.fmean(rs))
        assert t.variance == pytest.approx(statistics.variance(rs))
    assert buf.version_rewards("nobody") == {}


def test_an_episodes_turns_count_once_in_the_reward_tally(redis_client, tenant_id):
    """The reward guard compares versions by reward per episode: a three-turn episode is one
    observation, not three. Every turn stays a training sample."""
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))

    def turn(n: int, reward: float, version: int, episode: str | None) -> PendingWrite:
        return PendingWrite(f"fb{n}", [_rl(tenant_id, n, reward, version, episode=episode)])

    buf.add_many(tenant_id, [turn(1, 1.0, 1, "ep-a"), turn(2, 1.0, 1, "ep-a")], now=time.time())   # one call
    buf.add_many(tenant_id, [turn(3, 1.0, 2, "ep-a")], now=time.time())     # its last turn, served by v2
    buf.add_many(tenant_id, [turn(4, 0.0, 1, "ep-b"), turn(5, 0.0, 2, None), turn(6, 0.5, 2, None)],
                 now=time.time())
    buf.add_examples(tenant_id, "fb7", [_rl(tenant_id, 7, 1.0, 1, episode="ep-b")], now=time.time())
    tallies = buf.version_rewards(tenant_id)
    assert (tallies[1].n, tallies[1].mean) == (2, 0.5)      # ep-a (1.0) and ep-b (0.0), each once
    assert (tallies[2].n, tallies[2].mean) == (2, 0.25)     # the two samples without an episode; not ep-a
    assert buf.depth(tenant_id, "rl") == 7


def test_sampling_validates_arguments(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client)
    with pytest.raises(ValueError, match="n must be"):
        buf.sample(tenant_id, "sft", 0)
    with pytest.raises(ValueError, match="fresh_fraction"):
        buf.sample(tenant_id, "sft", 1, fresh_fraction=2)


def test_heldout_split_is_stable_and_separate(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.2))
    fill(buf, tenant_id, range(200))
    held = {e.example_id for e in buf.heldout(tenant_id, "sft")}
    train = {e.example_id for e in buf.latest(tenant_id, "sft", 1000)}
    assert held and not held & train and len(held | train) == 200
    assert all(is_heldout(x, 0.2) for x in held) and 20 <= len(held) <= 60
    ordered = [e.example_id for e in buf.heldout(tenant_id, "sft")]
    assert [e.example_id for e in buf.heldout(tenant_id, "sft", 5)] == ordered[:5]  # the gate's: the oldest


def test_feedback_first_then_interaction_joins_once(redis_client, tenant_id):
    from clora.ingest.joiner import build_examples
    from clora.ingest.schemas import FeedbackEvent, FeedbackIn, InteractionEvent

    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    fb = FeedbackEvent.accept(tenant_id, FeedbackIn(interaction_id="i9", event_id="f9", score=1.0))
    assert buf.park_feedback(tenant_id, fb.event_id, "i9", fb.model_dump_json(), now=time.time()) == 1
    assert buf.park_feedback(tenant_id, fb.event_id, "i9", fb.model_dump_json(), now=time.time()) == 0
    ix = InteractionEvent(tenant=tenant_id, interaction_id="i9", messages=[{"role": "user", "content": "q"}],
                          response={"role": "assistant", "content": "a"})
    for _ in range(2):  # a redelivered interaction drains nothing twice
        for body in buf.store_interaction(tenant_id, ix.event_id, "i9", ix.model_dump_json(), now=time.time()):
            f = FeedbackEvent.model_validate_json(body)
            buf.add_examples(tenant_id, f.event_id, build_examples(ix, f), now=time.time(), parked_for="i9")
    assert buf.depth(tenant_id, "rl") == 1
    assert buf.version_rewards(tenant_id)[None].n == 1
    # with the interaction stored, parking is refused: the caller must join directly
    assert buf.park_feedback(tenant_id, "f10", "i9", fb.model_dump_json(), now=time.time()) == -1


def test_a_batch_of_writes_answers_what_each_write_alone_would(redis_client, tenant_id):
    """One pipeline for the worker's writes: each call's reply decoded in the order queued."""
    from clora.ingest.schemas import FeedbackEvent, FeedbackIn, InteractionEvent

    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    fb = FeedbackEvent.accept(tenant_id, FeedbackIn(interaction_id="i7", event_id="f7", score=1.0))
    assert buf.add_examples(tenant_id, "fb1", [sft(tenant_id, 1)], now=time.time()) == 1
    batch = buf.batch()
    batch.park_feedback(tenant_id, fb.event_id, "i7", fb.model_dump_json(), now=time.time())
    batch.park_feedback(tenant_id, fb.event_id, "i7", fb.model_dump_json(), now=time.time())
    batch.add_many(tenant_id, [PendingWrite("fb2", [sft(tenant_id, 2)]), PendingWrite("fb1", [sft(tenant_id, 1)])],
                   now=time.time())
    assert batch.execute() == [ParkResult.PARKED, ParkResult.DUPLICATE, [1, 0]]
    ix = InteractionEvent(tenant=tenant_id, interaction_id="i7", messages=[{"role": "user", "content": "q"}],
                          response={"role": "assistant", "content": "a"})
    batch = buf.batch()
    batch.store_interaction(tenant_id, ix.event_id, "i7", ix.model_dump_json(), now=time.time())
    batch.park_feedback(tenant_id, "f8", "i7", fb.model_dump_json(), now=time.time())
    (parked,), park = batch.execute()
    assert FeedbackEvent.model_validate_json(parked).event_id == "f7"
    assert park == ParkResult.INTERACTION_STORED
    assert buf.stored_interactions([(tenant_id, "i7"), (tenant_id, "i8"), (tenant_id, "i7")]) == [ix, None, ix]


def _script_exists_calls(client) -> int:
    return client.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0)


def test_a_batch_asks_no_script_exists_and_survives_a_flushed_script_cache(redis_client, tenant_id):
    """A batch sends its scripts by SHA1 without redis-py's `SCRIPT EXISTS` round trip first;
    when Redis has lost its scripts (restart, SCRIPT FLUSH) the batch loads them and is sent
    again, and what had run before stores nothing twice."""
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    assert buf.add_examples(tenant_id, "fb1", [sft(tenant_id, 1)], now=time.time()) == 1   # scripts loaded
    before = _script_exists_calls(redis_client)
    batch = buf.batch()
    batch.add_many(tenant_id, [PendingWrite("fb2", [sft(tenant_id, 2)])], now=time.time())
    assert batch.execute() == [[1]]
    assert _script_exists_calls(redis_client) == before

    redis_client.script_flush()
    batch = buf.batch()
    batch.add_many(tenant_id, [PendingWrite("fb3", [sft(tenant_id, 3)]), PendingWrite("fb2", [sft(tenant_id, 2)])],
                   now=time.time())
    batch.park_feedback(tenant_id, "f9", "i9", '{"event_id": "f9"}', now=time.time())
    assert batch.execute() == [[1, 0], ParkResult.PARKED]
    assert sorted(train_ids(buf, tenant_id)) == [1, 2, 3]
    assert buf.stats(tenant_id) == {"added": 3, "duplicates": 1}


def test_buffers_survive_redis_restart(stack, redis_client, tenant_id, wait_for):
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    fill(buf, tenant_id, range(50))
    redis_proc = stack.processes["redis"]
    redis_proc.kill()                         # SIGKILL: no shutdown save, only the AOF
    redis_proc.start()
    assert wait_for(lambda: _ping(redis_client), what="redis back")
    assert buf.depth(tenant_id, "sft") == 50
    assert sorted(train_ids(buf, tenant_id)) == list(range(50))


def _ping(client) -> bool:
    import redis

    try:
        return client.ping()
    except redis.ConnectionError:
        return False


def test_untrained_feedback_is_counted_once_per_event_by_reason(redis_client, tenant_id):
    buf = ReplayBuffer(redis_client)
    now = time.time()
    writes = [PendingWrite("fb1", [], '{"event_id": "fb1"}', untrained="unknown_key"),
              PendingWrite("fb2", [sft(tenant_id, 2)], "", untrained="unknown_key"),   # its correction trains
              PendingWrite("fb3", [], "", untrained="out_of_range"),
              PendingWrite("fb4", [_rl(tenant_id, 4, 1.0, None)])]
    assert buf.add_many(tenant_id, writes, now=now) == [1, 1, 1, 1]
    assert buf.add_many(tenant_id, writes[:2], now=now) == [0, 0]             # redelivered: counted once
    # parked feedback joined later is counted when its guard lets it through, once
    buf.park_feedback(tenant_id, "fb5", "i5", "{}", now=now)
    joined = PendingWrite("fb5", [], "", parked_for="i5", untrained="untrusted_source")
    assert buf.add_many(tenant_id, [joined], now=now) == [1]
    assert buf.add_many(tenant_id, [joined], now=now) == [0]
    assert buf.untrained_feedback(tenant_id) == {"unknown_key": 2, "out_of_range": 1, "untrusted_source": 1}
    assert buf.stats(tenant_id)["added"] == 2 and buf.depth(tenant_id, "rl") + buf.depth(tenant_id, "rl", heldout=True) == 1
    assert [f["event_id"] for f in buf.recent_feedback(tenant_id)] == ["fb1"]   # stored and listed


def test_interactions_stored_in_one_call_each_count_once_and_drain_their_own_parked_feedback(redis_client,
                                                                                             tenant_id):
    from clora.ingest.buffers import InteractionWrite
    from clora.ingest.schemas import FeedbackEvent, FeedbackIn, InteractionEvent
    from clora.ingest.signals import ReplyTraits

    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    fb = FeedbackEvent.accept(tenant_id, FeedbackIn(interaction_id="i2", event_id="f2", score=1.0))
    assert buf.park_feedback(tenant_id, fb.event_id, "i2", fb.model_dump_json(), now=time.time()) == 1
    ixs = [InteractionEvent(tenant=tenant_id, interaction_id=f"i{i}", adapter_version=1,
                            messages=[{"role": "user", "content": "q"}], response={"role": "assistant", "content": "a"})
           for i in range(3)]
    writes = [InteractionWrite(ix.event_id, ix.interaction_id, ix.model_dump_json(), ReplyTraits.of(ix)) for ix in ixs]
    parked = buf.store_interactions(tenant_id, writes + writes[:1], now=time.time())   # i0 twice in one call
    assert [[FeedbackEvent.model_validate_json(b).event_id for b in bodies] for bodies in parked] == [[], [], ["f2"], []]
    assert buf.store_interactions(tenant_id, writes, now=time.time())[2] == parked[2]   # redelivered: still parked
    assert buf.served_signals(tenant_id)[1].n == 3
    assert buf.stored_interactions([(tenant_id, "i1"), (tenant_id, "i3")]) == [ixs[1], None]


def test_a_batch_call_longer_than_a_script_chunk_answers_as_one_call(redis_client, tenant_id, monkeypatch):
    """Calls of many events go to Redis as several script calls (`SCRIPT_CHUNK`); the batch still
    answers each call once, with its events' results in order, duplicates found across chunks."""
    import clora.ingest.buffers as buffers
    from clora.ingest.buffers import InteractionWrite
    from clora.ingest.schemas import FeedbackEvent, FeedbackIn, InteractionEvent

    monkeypatch.setattr(buffers, "SCRIPT_CHUNK", 4)
    buf = ReplayBuffer(redis_client, BufferPolicy(holdout_fraction=0.0))
    fb = FeedbackEvent.accept(tenant_id, FeedbackIn(interaction_id="i9", event_id="f9", score=1.0))
    assert buf.park_feedback(tenant_id, fb.event_id, "i9", fb.model_dump_json(), now=time.time()) == 1
    writes = [PendingWrite(f"fb{i}", [sft(tenant_id, i)]) for i in range(10)]
    ixs = [InteractionEvent(tenant=tenant_id, interaction_id=f"i{i}", messages=[{"role": "user", "content": "q"}],
                            response={"role": "assistant", "content": "a"}) for i in range(6, 11)]
    batch = buf.batch()
    batch.add_many(tenant_id, writes + writes[2:3] + writes[9:], now=time.time())    # fb2, fb9 again, chunks apart
    batch.store_interactions(tenant_id, [InteractionWrite(ix.event_id, ix.interaction_id, ix.model_dump_json())
                                         for ix in ixs], now=time.time())
    batch.add_many(tenant_id, [], now=time.time())
    added, parked, nothing = batch.execute()
    assert added == [1] * 10 + [0, 0]
    assert [[FeedbackEvent.model_validate_json(b).event_id for b in bodies] for bodies in parked] == [[], [], [], ["f9"], []]
    assert nothing == []
    assert sorted(train_ids(buf, tenant_id)) == list(range(10))
