"""A tensor comparison with a tolerance that bounds none of its metrics would pass anything (a check that cannot
fail): `within` refuses it. Found in a golden probe that compared pixel values with `Tolerance()`."""

import pytest
import torch

from manifests.parity import Tolerance
from parity.metrics import compare, within


def test_an_unbounded_tolerance_is_refused():
    m = compare(torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="needs a bound"):
        within(m, Tolerance())
    with pytest.raises(ValueError, match="needs a bound"):
        within(m, Tolerance(min_ssim=0.9))   # an image metric does not bound a tensor comparison
    assert not within(m, Tolerance(max_abs=0.0)) and within(compare(torch.ones(3), torch.ones(3)), Tolerance(max_abs=0.0))
