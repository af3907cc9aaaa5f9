"""Fixtures for tests against a real broker: one embedded Tansu per test session."""

from __future__ import annotations

import gc
import re
import uuid
from collections.abc import Callable

import pytest

from launch.broker import EmbeddedBroker


@pytest.fixture(scope="session")
def broker():
    """A Tansu broker on 127.0.0.1 (free port, memory storage) shared by the session.

    Tests that kill or restart a broker start their own EmbeddedBroker instead.
    """
    with EmbeddedBroker() as b:
        yield b
        # Tansu's SIGTERM waits ~5 s for connected clients; clients that tests left in
        # reference cycles (e.g. in kept tracebacks) would hold stop() to its grace time.
        gc.collect()


@pytest.fixture
def unique_name(request) -> Callable[[str], str]:
    """``unique_name(prefix)`` -> a name no other test uses (for run ids and topics).

    Legal as a Kafka topic and a file name; includes the test's name for debugging.
    """
    test = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:60]

    def make(prefix: str = "t") -> str:
        return f"{prefix}-{test}-{uuid.uuid4().hex[:8]}"

    return make
