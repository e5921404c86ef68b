"""Live gloo ranks shared by the tests of one module (starting ranks costs seconds each)."""

from __future__ import annotations

import pytest

from hf_launch import SHARED_TWO_PROCESS_CASES, torchrun
from shardspeed.testing import RankPool


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4) as pool:
        yield pool


@pytest.fixture(scope="session")
def hf2(tmp_path_factory):
    """One 2-process launch of every Hugging Face, TRL and PEFT case that runs at 2 processes;
    each case writes its results under the returned folder."""
    return torchrun(2, tmp_path_factory.mktemp("hf2"), SHARED_TWO_PROCESS_CASES)
