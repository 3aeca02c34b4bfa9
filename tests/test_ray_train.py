"""A real Ray Train TorchTrainer job on CPU using the contract API."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from rtop.workload import WorkloadSpec, ray_train_loop  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_ray_train_ranks_report_with_ray_world_ranks(listener, ray_cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # The contract: collectors.start() with no arguments, hub from the environment.
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {
        "RTOP_HUB": listener.address, "RTOP_TOKEN": listener.token}})
    spec = WorkloadSpec(world_size=2, steps=25, dim=64, hidden=128, layers=2, batch=16,
                        loader="ray_data")
    import numpy as np

    rows = 2 * spec.steps * spec.batch
    dataset = ray.data.from_items(
        [{"x": np.random.rand(spec.dim).astype("float32"), "y": float(i % 7)}
         for i in range(rows)])
    trainer = TorchTrainer(
        ray_train_loop,
        datasets={"train": dataset},
        train_loop_config={"spec": spec.to_json()},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp_path), name="rtop-ray-test"),
    )
    trainer.fit()
    ray.shutdown()
    steps = listener.records("steps")
    assert sorted(steps) == [0, 1]
    for rank in (0, 1):
        hello = listener.hellos[rank]["identity"]
        assert hello["source"] == "ray"
        assert hello["rank"] == rank and hello["world_size"] == 2
        assert hello["job"], "Ray Train's run id is the job"
        assert hello["group"], "the worker group's id tells attempts apart"
        assert len(steps[rank]) == 25
        assert all(r["comm_bytes"] and r["comm_bytes"] > 0 for r in steps[rank])
        # the probe wrapped Ray Data's iter_torch_batches iterator
        assert all(r["data_wait_s"] is not None for r in steps[rank])
        assert all(r["samples"] == spec.batch for r in steps[rank])
    assert listener.hellos[0]["identity"]["group"] == listener.hellos[1]["identity"]["group"]


def test_hub_actor_is_made_through_the_seam(ray_cluster):
    """What a Ray Train rank does without RTOP_HUB: make its job's hub actor (the class
    that collectors names only at its seam, rtop.hub.ray_actor) and reach its hub."""
    import os

    from collectors import discovery, wire
    from collectors.identity import Identity
    from tests.rankclient import RankClient

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {
            "RTOP_RUNS_DIR": os.environ["RTOP_RUNS_DIR"]}})
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

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {
            "RTOP_RUNS_DIR": os.environ["RTOP_RUNS_DIR"]}})
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
