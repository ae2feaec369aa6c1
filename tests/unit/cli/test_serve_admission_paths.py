"""Every way of deploying a serve spec goes through the same queue admission (issue 33; no Ray).

``rayfleet serve spec.yaml`` (``deployer.deploy``, as ``fleet.serve(spec)``) admitted each pool
through its queue, but the config ``rayfleet serve spec.yaml --serve-config`` prints, deployed with
Ray's own ``serve deploy``/``serve run``, built the app through the engine's ``app_builder`` without
asking the queues. Both now run ``deploy.pool_admission.admit_app``. Each path is driven here from
the CLI against an in-process fleet controller (reconcile parked, as in
tests/unit/serving/test_pool_queue.py), with Serve and Ray's KV stubbed: a path that skips
admission would run or build an app its queue refused, and these tests would fail.

Queue ``inference``: quota 8 H100, no borrowing, on a fleet of 32. A colocated pool asks for
1..3 replicas of 8 H100, so its queue grants 1 and a second app does not fit.
"""

from __future__ import annotations

import importlib

import pytest
import yaml

from rayfleet.cli import main
from rayfleet.platform.controller import FleetController
from rayfleet.serving import deployer
from rayfleet.serving.deploy import pool_admission, pool_scaling
from rayfleet.serving.deploy.pool_admission import PoolRefusedError

FLEET = 32


def serve_spec(name: str, queue: str = "inference", engine: str = "builtin") -> dict:
    model = {"hf": "/models/tiny-moe"} if engine == "vllm" else {"preset": "tiny"}
    spec = {"name": name, "mode": "colocated", "model": model, "http": {"auth": "disabled"},
            "colocated": {"replicas": 1, "max_replicas": 3, "accelerators_per_replica": 8,
                          "accelerator_type": "H100", "queue": queue}}
    if engine == "vllm":
        spec.update(engine={"kind": "vllm", "block_size": 32}, vllm={"device": "cpu"})
    return spec


@pytest.fixture
def controller(tmp_path, monkeypatch):
    """The fleet controller the deploy paths reach, and what they wrote to Serve's bounds."""
    ctl = FleetController(str(tmp_path / "state.sqlite"), reconcile_s=3600.0)
    ctl.admission.ray_idle = lambda: {"H100": FLEET - sum(r["held"] for r in ctl.admissions())}
    ctl.apply_queues([{"name": "inference", "quota": {"H100": 8}, "borrow_limit": {"H100": 0}}])
    ctl.bounds = {}
    monkeypatch.setattr(pool_admission, "ray_connected", lambda: True)  # as under Serve, in the cluster
    monkeypatch.setattr(pool_admission, "controller_call",
                        lambda pools=None: lambda method, *args: getattr(ctl, method)(*args))
    monkeypatch.setattr(pool_scaling, "set_pool_bounds", lambda app, deployment, *, min_replicas, max_replicas:
                        ctl.bounds.__setitem__((app, deployment), (min_replicas, max_replicas)))
    yield ctl
    ctl._stop.set()


def held(controller) -> dict[str, tuple[str, int, int]]:
    return {r["request"]["job_id"]: (r["state"], r["size"], r["held"]) for r in controller.admissions()}


def write(tmp_path, spec: dict):
    path = tmp_path / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_rayfleet_serve_admits_the_pools_before_it_runs_the_app(controller, tmp_path, monkeypatch, capsys):
    from ray import serve

    ran = []
    monkeypatch.setattr(deployer, "_ensure_connected", lambda address: None)
    monkeypatch.setattr(serve, "start", lambda **kw: None)
    monkeypatch.setattr(deployer, "_run_and_wait", lambda spec, build, health, key, deadline: (
        ran.append(spec.name) or deployer.ServeDeployment(spec=spec, url="http://127.0.0.1:1")))

    assert main(["serve", write(tmp_path, serve_spec("chat")), "--detach"]) == 0
    assert ran == ["chat"]
    assert held(controller) == {"serve:chat/colocated": ("ADMITTED", 8, 8)}  # reported started
    assert controller.bounds == {("chat", "colocated"): (1, 1)}  # 1..3 capped at the 1 replica granted

    capsys.readouterr()
    assert main(["serve", write(tmp_path, serve_spec("full")), "--detach"]) == 2
    err = capsys.readouterr().err
    assert ("colocated.replicas=1: Serve pool full/colocated does not fit in queue inference: it asks for 8 H100 "
            "(1 x 8); its H100 quota is 8, 8 in use") in err, err
    assert "Fix: lower the pool's replicas, raise queue inference's H100 quota" in err
    assert main(["serve", write(tmp_path, serve_spec("lost", queue="nope")), "--detach"]) == 2
    err = capsys.readouterr().err
    assert "colocated.queue='nope': no such queue on this fleet (queues: inference)" in err, err
    assert "rayfleet queue apply" in err and "leave `colocated.queue` unset" in err
    assert ran == ["chat"] and set(controller.bounds) == {("chat", "colocated")}  # neither went further
    assert held(controller) == {"serve:chat/colocated": ("ADMITTED", 8, 8)}


@pytest.mark.parametrize("engine, module, build", [
    ("builtin", "rayfleet.serving.openai_api.serve_app", "build_app"),
    ("vllm", "rayfleet.serving.vllm.app", "build_vllm_app"),
])
def test_serve_deploy_of_the_printed_config_admits_through_the_same_path(controller, tmp_path, monkeypatch,
                                                                         capsys, engine, module, build):
    """What ``serve deploy`` does with the config: import ``import_path`` and call it with ``args``
    (inside the cluster; here in-process). The broken variant is the old builder, which built the
    app without asking: the refused app below would have been built."""
    built = []
    monkeypatch.setattr(importlib.import_module(module), build, lambda spec: built.append(spec.name) or spec.name)

    def serve_deploy(spec: dict):
        capsys.readouterr()
        assert main(["serve", write(tmp_path, spec), "--serve-config"]) == 0
        (app,) = yaml.safe_load(capsys.readouterr().out)["applications"]
        path, _, attr = app["import_path"].partition(":")
        assert path == module
        return getattr(importlib.import_module(path), attr)(app["args"])

    assert serve_deploy(serve_spec("chat", engine=engine)) == "chat"
    assert held(controller) == {"serve:chat/colocated": ("ADMITTED", 8, 8)}  # counted once built
    assert list(controller.bounds.values()) == [(1, 1)]  # capped at the grant, as rayfleet serve caps it

    with pytest.raises(PoolRefusedError, match=r"colocated.replicas=1: Serve pool full/colocated does not fit"):
        serve_deploy(serve_spec("full", engine=engine))
    with pytest.raises(PoolRefusedError, match=r"colocated.queue='nope': no such queue.*rayfleet queue apply"):
        serve_deploy(serve_spec("lost", queue="nope", engine=engine))
    assert built == ["chat"] and len(controller.bounds) == 1
    assert list(held(controller)) == ["serve:chat/colocated"]


def test_an_app_that_fails_to_build_gives_its_grant_back(controller, tmp_path, monkeypatch):
    from rayfleet.serving.openai_api import serve_app

    def broken(spec):
        raise RuntimeError("engine config rejected")

    monkeypatch.setattr(serve_app, "build_app", broken)
    with pytest.raises(RuntimeError, match="engine config rejected"):
        serve_app.app_builder(serve_spec("chat"))
    assert controller.admissions() == []
