"""The keyword arguments the session builds DDP with: the script's first, per-bucket caps from the first step."""

from __future__ import annotations

from typing import Any

import pytest

from elastrain.session.runtime import DDP_BUCKET_CAP_MB, ddp_kwargs


@pytest.mark.parametrize(
    ("script", "in_sync", "expected"),
    [
        ({}, False, {"bucket_cap_mb_list": [DDP_BUCKET_CAP_MB]}),
        ({}, True, {"init_sync": False, "bucket_cap_mb_list": [DDP_BUCKET_CAP_MB]}),
        ({"init_sync": True}, True, {"init_sync": True, "bucket_cap_mb_list": [DDP_BUCKET_CAP_MB]}),
        ({"bucket_cap_mb": 50}, False, {"bucket_cap_mb": 50, "bucket_cap_mb_list": [50]}),
        ({"bucket_cap_mb_list": [1, 10]}, False, {"bucket_cap_mb_list": [1, 10]}),
        (
            {"find_unused_parameters": True},
            False,
            {"find_unused_parameters": True, "bucket_cap_mb_list": [DDP_BUCKET_CAP_MB]},
        ),
    ],
)
def test_ddp_kwargs_by_table(script: dict[str, Any], in_sync: bool, expected: dict[str, Any]) -> None:
    assert ddp_kwargs(script, in_sync) == expected
    assert ddp_kwargs(script, in_sync) is not script  # the script's mapping is never changed
