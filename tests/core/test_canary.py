"""The canary's rule (clora.canary): a replica's adapter must reproduce the learner's numbers
within a tolerance that grows with the arithmetic gap the base itself shows, and each way of
failing is named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from clora.canary import CANARY_ATOL, CANARY_NOISE_FACTOR, AdapterCanary, check_applied

BASE = [-2.90, -0.31, -4.00, -1.20]
ADAPTER = [-2.10, -0.52, -3.10, -0.70]
CANARY = AdapterCanary(prompt_token_ids=[1, 2, 3, 4, 5], logprobs=ADAPTER, base_logprobs=BASE)


def shifted(values: list[float], by: float) -> list[float]:
    return [v + by for v in values]


def test_an_fp32_replica_matches_within_about_a_hundredth():
    v = CANARY.check(shifted(ADAPTER, 2e-5), shifted(BASE, 1e-5))
    assert v.passed and v.outcome == "matched"
    assert v.tolerance == pytest.approx(CANARY_ATOL + CANARY_NOISE_FACTOR * 1e-5)
    assert not CANARY.check(shifted(ADAPTER, 0.02), shifted(BASE, 1e-5)).passed


def test_the_tolerance_follows_the_bases_own_gap_as_bf16_arithmetic_widens_it():
    """A bf16 replica's base is 0.04 nats/token from the fp32 learner's: the adapter may be 0.13 off."""
    v = CANARY.check(shifted(ADAPTER, 0.12), shifted(BASE, 0.04))
    assert v.outcome == "matched" and v.tolerance == pytest.approx(0.13)
    assert CANARY.check(shifted(ADAPTER, 0.14), shifted(BASE, 0.04)).outcome == "mismatch"


def test_the_base_answering_under_the_adapters_name_is_not_applied():
    v = CANARY.check(list(BASE), list(BASE))
    assert not v.passed and v.outcome == "not_applied" and "not applied" in v.reason


def test_another_adapter_under_the_name_is_a_mismatch():
    v = CANARY.check([-1.0, -1.9, -2.2, -0.1], list(BASE))
    assert not v.passed and v.outcome == "mismatch" and "another adapter" in v.reason


def test_another_base_model_cannot_be_compared():
    v = CANARY.check(list(ADAPTER), shifted(BASE, 0.8))
    assert not v.passed and v.outcome == "base_mismatch"


def test_a_version_the_canary_cannot_tell_from_the_base_is_served_and_says_so():
    zero = AdapterCanary(prompt_token_ids=[1, 2, 3, 4, 5], logprobs=list(BASE), base_logprobs=list(BASE))
    v = zero.check(list(BASE), list(BASE))
    assert v.passed and v.outcome == "indistinct" and "cannot tell it from the base" in v.reason


def test_a_wrong_number_of_logprobs_is_malformed_and_a_canary_must_be_whole():
    assert CANARY.check(ADAPTER[:2], BASE[:2]).outcome == "malformed"
    with pytest.raises(ValidationError, match="needs 4 log-probabilities"):
        AdapterCanary(prompt_token_ids=[1, 2, 3, 4, 5], logprobs=ADAPTER[:3], base_logprobs=BASE)


def test_without_a_canary_a_change_from_the_base_counts_as_applied_and_none_is_unverified():
    assert check_applied(ADAPTER, BASE).outcome == "applied"
    v = check_applied(BASE, BASE)
    assert v.passed and v.outcome == "unverified"


def test_the_canary_survives_the_registry_record():
    from clora.registry import AdapterVersion

    av = AdapterVersion(version=3, path="/a/v3", base_model="tiny", canary=CANARY)
    assert AdapterVersion.model_validate_json(av.model_dump_json()).canary == CANARY
    assert AdapterVersion.model_validate_json(av.model_dump_json(exclude={"canary"})).canary is None
