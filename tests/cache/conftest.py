"""Fixtures of the cache tests."""

import pytest

from bitkern.cache import forget


@pytest.fixture
def fresh_process_map():
    """An empty in-process kernel map before and after the test, so that each test sees only its own stores."""
    forget()
    yield
    forget()
