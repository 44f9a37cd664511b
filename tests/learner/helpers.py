"""Example builders shared by learner tests."""

from __future__ import annotations

from clora.ingest.schemas import Message, PreferencePair, RLSample, SFTExample


def _base(tenant: str, i: int) -> dict:
    return dict(example_id=f"{tenant}-{i}", tenant=tenant, interaction_id=f"i-{i}",
                feedback_event_id=f"fb-{i}", time=1000.0 + i)


def sft(tenant: str, i: int, question: str, answer: str) -> SFTExample:
    return SFTExample(**_base(tenant, i), messages=[Message(role="user", content=question)],
                      target=Message(role="assistant", content=answer))


def pref(tenant: str, i: int, question: str, chosen: str, rejected: str) -> PreferencePair:
    return PreferencePair(**_base(tenant, i), messages=[Message(role="user", content=question)],
                          chosen=Message(role="assistant", content=chosen),
                          rejected=Message(role="assistant", content=rejected))


def rl(tenant: str, i: int, question: str, answer: str, reward: float, group: str, **kw) -> RLSample:
    return RLSample(**_base(tenant, i), messages=[Message(role="user", content=question)],
                    response=Message(role="assistant", content=answer), reward=reward, group_id=group, **kw)


def sft_set(tenant: str, answer: str, n: int = 4) -> list[SFTExample]:
    return [sft(tenant, i, f"q{i}?", answer) for i in range(n)]
