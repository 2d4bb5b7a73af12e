"""The controller, senders and receivers as actors on a real local Ray cluster."""

from __future__ import annotations

import math
import os
import pathlib

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'weightsync[ray]')")

from weightsync.roles.integrations.ray_actors import ControllerActor  # noqa: E402

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def cluster():
    path = os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_actors_push_versions_to_inference_actors(cluster):
    import ray_helpers

    controller = ray.remote(ControllerActor).remote(senders=2, receivers=2)
    address = ray.get(controller.start.remote(), timeout=120)
    trainers = [ray.remote(ray_helpers.Trainer).remote() for _ in range(2)]
    inference = [ray.remote(ray_helpers.Inference).remote() for _ in range(2)]
    ray.get([t.weightsync_start.remote(address, rank) for rank, t in enumerate(trainers)]
            + [i.weightsync_start.remote(address, rank) for rank, i in enumerate(inference)], timeout=120)
    for version in (1, 2):
        ray.get([t.step.remote(version) for t in trainers], timeout=60)
        sent = ray.get([t.weightsync_push.remote(version) for t in trainers], timeout=120)
        assert all(s["bytes"] > 0 for s in sent)  # the two data-parallel ranks split the push
        assert ray.get([i.weightsync_wait.remote(version) for i in inference], timeout=60) == [version] * 2
        want = ray_helpers.fingerprint(ray_helpers.weights(version))
        assert ray.get([i.fingerprint.remote() for i in inference], timeout=60) == [want, want]
    report = ray.get(controller.wait_round.remote(2), timeout=60)
    total = sum(4 * math.prod(shape) for shape in ray_helpers.SHAPES.values())  # float32
    assert report["version"] == 2 and report["bytes"] == 2 * total
    status = ray.get([i.weightsync_status.remote() for i in inference], timeout=60)
    assert [s["version"] for s in status] == [2, 2] and not any(s["dirty"] for s in status)
    ray.get([a.weightsync_close.remote() for a in [*trainers, *inference]], timeout=60)
    assert ray.get(controller.status.remote(), timeout=60)["committed"] == 2
    ray.get(controller.close.remote(), timeout=60)
