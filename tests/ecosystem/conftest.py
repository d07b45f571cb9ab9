from __future__ import annotations

import openai
import pytest

from tests.ecosystem.gateway_harness import GatewayProcess
from tests.fleet.harness import RedisServer


@pytest.fixture(scope="module")
def client(fleet: tuple[RedisServer, GatewayProcess]) -> openai.OpenAI:
    """An openai client on the module's live gateway (each module defines its `fleet`)."""
    return fleet[1].openai()
