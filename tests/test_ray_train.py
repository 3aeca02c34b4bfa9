"""The hub actor a Ray Train rank makes when no hub is given, through the seam
(``collectors.discovery.ray_hub``), on a real Ray cluster. (The contract API in a real
Ray Train job: tests/test_ray_restarts.py; a job finding the actor hub with no
settings: tests/test_hub_lifecycle.py.)"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray


def test_hub_actor_is_made_through_the_seam(ray_cluster):
    """What a Ray Train rank does without RTOP_HUB: make its job's hub actor (the class
    that collectors names only at its seam, rtop.hub.ray_actor) and reach its hub."""
    import os

    from collectors import discovery, wire
    from collectors.identity import Identity
    from tests.rankclient import RankClient

    ident = Identity(rank=0, local_rank=0, world_size=2, hostname="node-a", ip="127.0.0.1",
                     pid=os.getpid(), job="seam-test", group="g0", source="ray")
    host, port, token = discovery.ray_hub(ident)
    actor = ray.get_actor(discovery.ray_actor_name(ident), namespace=discovery.RAY_NAMESPACE)
    try:
        info = ray.get(actor.info.remote(), timeout=60)
        # listing hubs never hands out the token; ranks get the one the actor made
        assert info["job"] == "seam-test" and "token" not in info and token
        assert info["token_given"] is False
        assert wire.parse_address(info["address"]) == (host, port)
        assert discovery.ray_hub(ident) == (host, port, token), "a second actor was made"
        client = RankClient(f"{host}:{port}", token, rank=0)
        try:
            frame = client.recv(timeout=20)
            assert frame is not None and frame.kind == wire.KIND_WELCOME, frame
        finally:
            client.close()
        # any client of the cluster may call the actor: shutdown needs the master or
        # control token, which never leave it (the ranks' ingest token is not enough)
        for wrong in ((), ("not-the-token",), (token,)):
            with pytest.raises(ray.exceptions.RayTaskError, match="master or control"):
                ray.get(actor.shutdown.remote(*wrong), timeout=60)
        assert ray.get(actor.info.remote(), timeout=60)["address"] == info["address"]
    finally:
        ray.kill(actor)


def test_hub_actor_never_hands_out_a_token_the_job_gave(ray_cluster):
    """A job with a token of its own (RTOP_TOKEN in its runtime env) creates the actor
    with it; the actor then gives no token to anyone, and the ranks use their own."""
    import os

    from collectors import discovery, wire
    from collectors.identity import Identity
    from tests.rankclient import RankClient

    ident = Identity(rank=0, local_rank=0, world_size=2, hostname="node-a", ip="127.0.0.1",
                     pid=os.getpid(), job="seam-given", group="g0", source="ray")
    host, port, token = discovery.ray_hub(ident, token="the-job-s-own-token")
    assert token == "the-job-s-own-token"
    actor = ray.get_actor(discovery.ray_actor_name(ident), namespace=discovery.RAY_NAMESPACE)
    try:
        assert ray.get(actor.address.remote(), timeout=60)[2] is None
        assert ray.get(actor.view_token.remote(), timeout=60) is None
        info = ray.get(actor.info.remote(), timeout=60)
        assert "token" not in info and info["token_given"] is True
        # a rank that has no token of its own gets none from the actor
        assert discovery.ray_hub(ident) == (host, port, None)
        client = RankClient(f"{host}:{port}", token, rank=0)
        try:
            frame = client.recv(timeout=20)
            assert frame is not None and frame.kind == wire.KIND_WELCOME, frame
        finally:
            client.close()
    finally:
        ray.get(actor.shutdown.remote("the-job-s-own-token"), timeout=60)
        ray.kill(actor)
