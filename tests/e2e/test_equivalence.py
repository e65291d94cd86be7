"""The constant policy through world-size changes and kills ends where an uninterrupted run ends."""

from __future__ import annotations

import pytest
from support.ledger_chain import MAX_STEPS, assert_matches, elastic_chain, uninterrupted

pytestmark = pytest.mark.slow


def test_constant_policy_matches_the_uninterrupted_run() -> None:
    assert_matches(elastic_chain(), uninterrupted(), MAX_STEPS)
