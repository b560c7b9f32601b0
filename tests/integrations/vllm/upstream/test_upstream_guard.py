"""The guard fails a test that puts a connector of its own into a scheduler (bypassing kvsplice)."""

from __future__ import annotations

from unittest.mock import Mock

import pytest
import vllm_kv_connector_unit.utils as utils


def test_a_connector_of_the_tests_own_fails_the_guard() -> None:
    scheduler = utils.create_scheduler(utils.create_vllm_config())  # kvsplice's (conftest)
    scheduler.schedule()  # kvsplice's own connector: allowed
    scheduler.connector = utils.create_mock_connector()  # the stand-in over it: allowed
    scheduler.schedule()
    scheduler.connector = Mock()
    with pytest.raises(AssertionError, match="not kvsplice's"):
        scheduler.schedule()
