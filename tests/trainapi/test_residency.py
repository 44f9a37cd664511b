"""A tenant's Tinker runs held in the learner's memory are bounded per tenant: a further run
evicts the tenant's least recently used one (whose checkpoint keeps its steps), never another
tenant's run or adapter."""

from __future__ import annotations

import pytest

tinker = pytest.importorskip("tinker")

from .conftest import RANK  # noqa: E402
from .test_restart import ADAM, DATA  # noqa: E402


def test_a_tenants_extra_run_evicts_its_own_oldest_and_leaves_other_tenants_alone(service):
    service.settings.max_resident_runs = 1
    acme = tinker.ServiceClient(base_url=service.url, api_key=service.keys["acme"])
    beta = tinker.ServiceClient(base_url=service.url, api_key=service.keys["beta"])
    theirs = beta.create_lora_training_client(base_model="tiny", rank=RANK).result()
    theirs.forward_backward(DATA, "cross_entropy").result()        # beta's gradient waits in memory

    first = acme.create_lora_training_client(base_model="tiny", rank=RANK).result()
    first.forward_backward(DATA, "cross_entropy").result()
    first.optim_step(ADAM).result()
    first.forward_backward(DATA, "cross_entropy").result()         # a gradient for its next step
    second = acme.create_lora_training_client(base_model="tiny", rank=RANK).result()   # evicts `first`
    second.forward_backward(DATA, "cross_entropy").result()
    store = service.learner.store
    assert f"acme/tinker/{first.model_id}" not in store and f"acme/tinker/{second.model_id}" in store

    with pytest.raises(Exception, match="lost the gradient"):    # `first` reloads from its checkpoint
        first.optim_step(ADAM).result()
    assert store.state(f"acme/tinker/{first.model_id}").step == 1   # its applied step survived
    assert f"acme/tinker/{second.model_id}" not in store            # and it, in turn, evicted `second`

    out = theirs.optim_step(ADAM).result()                          # beta's run was never touched
    assert out.metrics["step:max"] == 1.0 and "grad_norm:mean" in out.metrics
