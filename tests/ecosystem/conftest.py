from __future__ import annotations

import openai
import pytest

from tests.harness.fleet import RedisServer
from tests.harness.gateway import GatewayProcess


@pytest.fixture(scope="module")
def client(fleet: tuple[RedisServer, GatewayProcess]) -> openai.OpenAI:
    """An openai client on the module's live gateway (each module defines its `fleet`)."""
    return fleet[1].openai()
