"""Live gloo ranks shared by the tests of one module (starting ranks costs seconds each)."""

from __future__ import annotations

import pytest

from shardspeed.testing import RankPool


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4) as pool:
        yield pool
