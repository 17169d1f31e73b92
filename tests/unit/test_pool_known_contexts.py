"""What the router knows a pool server holds of the contexts sent to it: one record for all
its members (the server shares one cache among its experts), kept only while the endpoint is
listed."""

from __future__ import annotations

import asyncio
import gc

from ddm.serving.router.fleet.servers import ModelServers, PoolSettings

POOL = "198.18.0.7:8000"


def test_a_pools_members_share_one_record_that_is_forgotten_with_the_endpoint() -> None:
    listed = {"expert-a": [POOL], "expert-b": [POOL], "alone": ["198.18.0.9:8000"]}

    def source(name: str):
        async def endpoints() -> list[str]:
            return list(listed[name])
        return endpoints

    servers = ModelServers({name: source(name) for name in listed}, PoolSettings(),
                           parse_info=lambda info: info,
                           members={"expert-a": "expert-a", "expert-b": "expert-b"})
    asyncio.run(servers.refresh())
    a, b = servers.replicas("expert-a")[0], servers.replicas("expert-b")[0]
    alone = servers.replicas("alone")[0]
    a.contexts[b"context-1"] = None
    assert b"context-1" in b.contexts  # sent through one member: the pool holds it for all
    assert alone.contexts is not a.contexts  # an expert alone keeps its own

    listed["expert-a"] = listed["expert-b"] = []  # the pool's pod is gone
    asyncio.run(servers.refresh())
    del a, b
    gc.collect()
    listed["expert-a"] = listed["expert-b"] = [POOL]  # a new pod at the same address
    asyncio.run(servers.refresh())
    assert not servers.replicas("expert-a")[0].contexts
    assert servers.replicas("expert-a")[0].contexts is servers.replicas("expert-b")[0].contexts
