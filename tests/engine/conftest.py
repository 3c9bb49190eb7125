"""Engine-test fixtures: every test that used a shared engine must leave all blocks free; the
default mode's environment."""

from __future__ import annotations

import os

import pytest

from tests.helpers import assert_all_blocks_free


@pytest.fixture(autouse=True)
def _all_blocks_free_after_test(request):
    yield
    for name in ("llm", "cold"):  # the engines shared across tests
        if name in request.fixturenames:
            assert_all_blocks_free(request.getfixturevalue(name))


@pytest.fixture(scope="module")
def default_env():
    """The default mode: what a user gets without options (the suite's conftest pins the exact
    mode through these variables)."""
    saved = {name: os.environ.pop(name, None) for name in ("KVMEMO_WEIGHTS", "KVMEMO_DTYPE")}
    yield
    for name, value in saved.items():
        if value is not None:
            os.environ[name] = value
