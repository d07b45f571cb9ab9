from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.harness.fleet import RedisServer
from tests.harness.gateway import MODEL_DIR, GatewayProcess, gateway_fleet


@pytest.fixture(scope="package")
def demo_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[RedisServer, GatewayProcess]]:
    """The committed demo model served as "tiny" by one worker behind a gateway (resume grace
    0.2 s), shared by the modules that only send it requests and start any other gateway they
    need on its Redis (test_gateway, test_gateway_clients): one start-up instead of one each."""
    with gateway_fleet(tmp_path_factory.mktemp("demo-fleet"), [(MODEL_DIR, "gw-worker", "tiny")],
                       "--resume-grace", "0.2") as pair:
        yield pair


@pytest.fixture(scope="module")
def client(fleet: tuple[RedisServer, GatewayProcess]) -> openai.OpenAI:
    """An openai client on the module's live gateway (each module defines its `fleet`)."""
    return fleet[1].openai()
