"""Interaction ids from the `openai` client's objects (duck-typed) or bare ids, as the gateway
records them: one choice under the response id, n > 1 choices as `{id}-{i}`."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from clora_client import choice_ids, interaction_id, interaction_ids, new_event_id, records


def completion(rid: str, n: int) -> SimpleNamespace:
    return SimpleNamespace(id=rid, object="chat.completion",
                           choices=[SimpleNamespace(index=i, message=None) for i in range(n)])


def test_a_single_choice_response_is_its_own_id():
    assert interaction_id(completion("chatcmpl-a", 1)) == "chatcmpl-a"
    assert interaction_id(completion("chatcmpl-a", 1), 0) == "chatcmpl-a"
    assert interaction_ids(completion("chatcmpl-a", 1)) == ["chatcmpl-a"]


def test_each_of_several_choices_is_named_by_its_index():
    c = completion("chatcmpl-b", 3)
    assert interaction_id(c, 2) == "chatcmpl-b-2" == interaction_id(c, c.choices[2])
    assert interaction_ids(c) == ["chatcmpl-b-0", "chatcmpl-b-1", "chatcmpl-b-2"] == choice_ids("chatcmpl-b", 3)


def test_a_response_with_several_choices_needs_one_named():
    with pytest.raises(ValueError, match="has 3 choices, each its own interaction: name one"):
        interaction_id(completion("chatcmpl-b", 3))
    with pytest.raises(ValueError, match="choice 3 is out of range"):
        interaction_id(completion("chatcmpl-b", 3), 3)
    with pytest.raises(ValueError, match="non-negative index"):
        interaction_id(completion("chatcmpl-b", 3), -1)


def test_dicts_bare_ids_and_responses_api_objects_work_too():
    assert interaction_id({"id": "chatcmpl-c", "choices": [{"index": 0}, {"index": 1}]}, 1) == "chatcmpl-c-1"
    assert interaction_id("chatcmpl-d") == "chatcmpl-d"
    assert interaction_id("chatcmpl-d", 1) == "chatcmpl-d-1"
    assert interaction_id("chatcmpl-d", 0, n=1) == "chatcmpl-d"
    assert interaction_id(SimpleNamespace(id="resp_abc", object="response", output=[])) == "resp_abc"
    with pytest.raises(TypeError, match="an object with an `id`"):
        interaction_id(SimpleNamespace(choices=[]))


def test_builders_take_the_response_object():
    rec = records.thumbs(completion("chatcmpl-e", 1), up=False)
    assert (rec.interaction_id, rec.score, rec.key, rec.source) == ("chatcmpl-e", 0.0, "thumbs", "user")
    with pytest.raises(TypeError, match="a rating is an integer"):
        records.rating("chatcmpl-e", 4.5)


def test_event_ids_are_fresh_and_shaped_as_the_platforms():
    ids = {new_event_id() for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("fb-") and len(i) == 35 for i in ids)


def test_importing_the_sdk_loads_no_platform_dependency():
    code = ("import sys, clora_client; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'fastapi', 'redis', 'kafka', "
            "'openai', 'clora', 'starlette', 'vllm'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
