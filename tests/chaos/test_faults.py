"""The chaos sequence: one cluster, one fault after another (the single faults of faults.py, in
its order). After each the job must recover and the invariants hold (survivors keep their PIDs,
contiguous steps, identical state, the events explain every change); no process is left behind
at the end. Recovery times go to the report."""

import pytest
from faults import SINGLE, named

pytestmark = pytest.mark.timeout(150)


@pytest.mark.parametrize("name", named(SINGLE))
def test_fault(chaos, name):
    fault = chaos.scenario(name)
    assert not fault.lost, f"survivors lost to a fault outside them: {fault.lost}"
