"""Engine-test fixtures: every test that used a shared engine must leave all blocks free."""

from __future__ import annotations

import pytest

from tests.helpers import assert_all_blocks_free


@pytest.fixture(autouse=True)
def _all_blocks_free_after_test(request):
    yield
    for name in ("llm", "cold"):  # the engines shared across tests
        if name in request.fixturenames:
            assert_all_blocks_free(request.getfixturevalue(name))
