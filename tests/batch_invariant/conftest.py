"""The kernel tests start with torch's own aten kernels: an in-process vLLM engine (tests/rollout,
tests/trainer) turns zmrl's aten overrides on for the rest of the session, which would route the
plain-torch negative controls here through zmrl's invariant ops. Tests of the overrides turn them
on inside, scoped."""
import pytest

import zmrl.batch_invariant as bi


@pytest.fixture(autouse=True)
def _aten_overrides_off():
    with bi.batch_invariant_mode(False):
        yield
