"""DataParallelClient stands in for ZmqEngineClient: both implement PipelineClient, and nothing public on the
single-replica client is left out of the interface (so a new method cannot be forgotten by the router)."""
from __future__ import annotations

import inspect

from appliance.runtime.dp_router import DataParallelClient
from appliance.runtime.frontend import ZmqEngineClient
from appliance.runtime.pipeline_client import PipelineClient
from appliance.server.engine_client import EngineClient


def public_members(cls: type) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}


def test_both_clients_implement_the_pipeline_client() -> None:
    for cls in (ZmqEngineClient, DataParallelClient):
        assert issubclass(cls, PipelineClient) and not inspect.isabstract(cls), cls


def test_every_public_member_of_the_replica_client_is_in_the_interface() -> None:
    assert public_members(ZmqEngineClient) <= set(PipelineClient.__abstractmethods__)
    assert set(PipelineClient.__abstractmethods__) <= public_members(DataParallelClient)


def test_the_interface_covers_the_servers_engine_client() -> None:
    wanted = {n for n in dir(EngineClient) if not n.startswith("_")}
    assert wanted <= set(PipelineClient.__abstractmethods__)


def test_signatures_match() -> None:
    for name in PipelineClient.__abstractmethods__:
        want = inspect.signature(getattr(PipelineClient, name)) if not isinstance(
            getattr(PipelineClient, name), property) else None
        for cls in (ZmqEngineClient, DataParallelClient):
            got = getattr(cls, name)
            if want is None:
                assert isinstance(got, property), (cls, name)
            else:
                assert inspect.signature(got).parameters.keys() == want.parameters.keys(), (cls, name)
