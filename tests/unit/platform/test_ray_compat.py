"""Ray's private modules are used in one place only: rayfleet/platform/ray_compat.py."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "rayfleet"
PRIVATE = ("ray._private", "ray._raylet", "ray.serve.context", "ray.autoscaler._private", "ray.serve._private",
           "ray.llm._internal", "ray.train.v2._internal")
ALLOWED = {"platform/ray_compat.py"}


def private_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a private Ray module, including imports inside functions."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names if any(n == p or n.startswith(p + ".") for p in PRIVATE)][:1]
    return out


def test_only_ray_compat_imports_private_ray_modules():
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted(ROOT.rglob("*.py")) if str(path.relative_to(ROOT)) not in ALLOWED
             for line, module in private_imports(path.read_text())]
    assert not found, "use rayfleet.platform.ray_compat instead:\n" + "\n".join(found)


def test_the_check_sees_private_imports_at_any_depth():
    broken = ("import ray._private.state\n"
              "def f():\n    from ray._raylet import PlacementGroupID\n"
              "class C:\n    def g(self):\n        from ray.serve import context\n        from ray.serve.context import x\n")
    assert [module for _, module in private_imports(broken)] == [
        "ray._private.state", "ray._raylet", "ray.serve.context", "ray.serve.context"]
    assert private_imports("import ray\nfrom ray.util.placement_group import placement_group\n") == []


def test_importing_ray_compat_does_not_import_ray():
    import subprocess

    code = "import sys, rayfleet.platform.ray_compat; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_auth_token_is_created_once_when_many_writers_race_for_it(tmp_path):
    """Two fleets started at once on a fresh machine must not write two different tokens."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from rayfleet.platform import ray_compat

    path = tmp_path / "ray" / "auth_token"
    start = threading.Barrier(8)

    def create(_):
        start.wait()
        return ray_compat.generate_auth_token(path)

    with ThreadPoolExecutor(8) as pool:
        created = list(pool.map(create, range(8)))
    assert sum(created) == 1, created  # exactly one writer made it; the rest found it there
    token = path.read_text()
    assert len(token) >= 16 and "\n" not in token
    assert [p.name for p in path.parent.iterdir()] == ["auth_token"]  # no temporary files left
    assert ray_compat.generate_auth_token(path) is False and path.read_text() == token  # never overwritten


def test_shared_host_daemons_scan_slowly_unless_the_environment_says_otherwise():
    from rayfleet.platform.ray_compat import shared_host_ray_env

    assert shared_host_ray_env({}) == {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "2",
                                       "REPORTER_UPDATE_INTERVAL_MS": "30000"}
    assert shared_host_ray_env({"LOG_NAME_UPDATE_INTERVAL_S": "0.5"})["LOG_NAME_UPDATE_INTERVAL_S"] == "0.5"
    assert shared_host_ray_env({"REPORTER_UPDATE_INTERVAL_MS": "5000"})["REPORTER_UPDATE_INTERVAL_MS"] == "5000"
    # the name is the one Ray 2.60's reporter reads
    import inspect

    from ray.dashboard.modules.reporter import reporter_consts

    assert 'env_integer(\n    "REPORTER_UPDATE_INTERVAL_MS"' in inspect.getsource(reporter_consts)


def test_rayfleets_trainer_starts_no_dataset_manager_without_datasets_and_no_pg_cleaner(tmp_path):
    """Ray Train's default callbacks less the two helper actors (built here without a cluster)."""
    import ray.train
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from rayfleet.platform.ray_compat import without_helper_actors

    def kinds(trainer) -> set[type]:
        return {type(c) for c in trainer._create_default_callbacks()}

    def make(cls, **kw):
        return cls(lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1),
                   run_config=ray.train.RunConfig(name="t", storage_path=str(tmp_path)), **kw)

    ours = without_helper_actors(TorchTrainer)
    assert ours.__name__ == "TorchTrainer" and issubclass(ours, TorchTrainer)
    stock = kinds(make(TorchTrainer))
    assert {DatasetsCallback, PlacementGroupCleanerCallback} <= stock  # what Ray Train starts by itself
    lean = kinds(make(ours))
    assert lean == stock - {DatasetsCallback, PlacementGroupCleanerCallback}
    with_data = kinds(make(ours, datasets={"train": lambda: None}))  # a dataset factory: no Ray started
    assert with_data == stock - {PlacementGroupCleanerCallback}  # a run with a Ray Dataset keeps its manager
