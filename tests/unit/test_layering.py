"""The package's layering rules, checked on every module's imports (no Ray, nothing imported).

Each ``rayfleet`` module is parsed with ``ast`` and every import in it counts, including imports
inside functions and under ``if TYPE_CHECKING`` (a lazy import is still a dependency: it breaks
the layering just the same, it only fails later). The rules (also in docs/architecture.md):

1. ``models`` imports neither Ray nor any rayfleet package but ``errors``;
2. ``storage`` imports nothing of rayfleet but ``errors``;
3. ``jobs`` and ``serving`` never import each other;
4. ``placement`` and ``platform`` import neither ``jobs`` nor ``serving``;
5. the user-facing layer is exactly the ``rayfleet/cli/`` package, ``rayfleet/sdk.py``,
   ``rayfleet/demo.py``, ``rayfleet/__main__.py`` and ``rayfleet/__init__.py``: only they import
   the SDK, the CLI or the demo, and they may import any area; every module inside ``models``,
   ``storage``, ``placement``, ``platform``, ``jobs`` and ``serving`` keeps rules 1-4 whatever its
   name (an area's ``cli.py`` or ``*_cli.py`` gets no exemption);
6. no import cycle between modules;
7. inside ``serving`` a room imports only its own room and lower rooms (``SERVING_RANK``).

A module's edge goes to the module it names (``from rayfleet.a import b`` names ``rayfleet.a.b``
when that is a module, else ``rayfleet.a``); parent packages' ``__init__`` runs are not counted,
since Python resolves those without a cycle. The checker is tested on a synthetic package with
deliberately broken imports, so a checker that finds nothing would fail here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "rayfleet"
# rayfleet.<name> modules of the user-facing layer; "cli" is a package and all of it faces users
USER_FACING_TOP = frozenset({"cli", "sdk", "demo", "__main__"})


@dataclass(frozen=True)
class Import:
    """One import statement's target as seen from ``importer`` (line numbers for the message)."""

    importer: str
    target: str
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def collect_imports(root: Path) -> tuple[set[str], list[Import]]:
    """Every module under ``root`` (a package directory) and every import each one makes."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    imports: list[Import] = []
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports += [Import(name, alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (_resolve_relative(name, is_package, node.level, node.module) if node.level
                        else node.module or "")
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    imports.append(Import(name, candidate if candidate in files else base, node.lineno))
    return set(files), imports


def _area(module: str) -> str:
    """``rayfleet.serving.engine.x`` -> ``serving``; top-level modules -> their own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def is_user_facing(module: str) -> bool:
    """Rule 5's layer: ``rayfleet`` itself (``rayfleet.connect`` is the SDK's), ``rayfleet.sdk``,
    ``rayfleet.demo``, ``rayfleet.__main__`` and every module of the ``rayfleet.cli`` package.

    Decided by place, never by name: ``rayfleet.storage.model_cli`` is a ``storage`` module.
    """
    parts = module.split(".")
    if len(parts) == 1:
        return True
    return parts[1] in USER_FACING_TOP and (len(parts) == 2 or parts[1] == "cli")


def _owned(target: str, modules: set[str]) -> str | None:
    """The rayfleet module an import names (longest existing prefix), or None if outside."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def rule_violations(modules: set[str], imports: list[Import], package: str = "rayfleet") -> list[str]:
    """Broken rules 1-5 as ``importer:line -> target (rule)`` lines."""
    out = []
    for imp in imports:
        src_area = _area(imp.importer)
        top = imp.target.split(".")[0]
        own = _owned(imp.target, modules) if top == package else None
        dst_area = _area(own) if own else None
        user_facing = is_user_facing(imp.importer)
        broken = None
        if src_area == "models" and top == "ray":
            broken = "models never imports Ray"
        elif user_facing:
            pass  # glue that faces users (e.g. rayfleet/cli/model.py): nothing else imports it
        elif src_area in ("models", "storage") and dst_area not in (None, src_area, "errors"):
            broken = f"{src_area} imports nothing of {package} but errors"
        elif own and dst_area in ("sdk", "cli", "demo"):
            broken = "only CLI/SDK/demo modules import the SDK, CLI or demo"
        elif {src_area, dst_area} == {"jobs", "serving"}:
            broken = "jobs and serving never import each other"
        elif src_area in ("placement", "platform") and dst_area in ("jobs", "serving"):
            broken = f"{src_area} imports neither jobs nor serving"
        if broken:
            out.append(f"{imp.importer}:{imp.line} -> {imp.target} ({broken})")
    return sorted(set(out))


def import_cycles(modules: set[str], imports: list[Import], package: str = "rayfleet") -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each as a sorted list."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        own = _owned(imp.target, modules) if imp.target.split(".")[0] == package else None
        if own and own != imp.importer:
            graph[imp.importer].add(own)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (~200)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def _describe_cycle(group: list[str], imports: list[Import], modules: set[str]) -> str:
    members = set(group)
    edges = sorted({f"{i.importer}:{i.line} -> {_owned(i.target, modules)}" for i in imports
                    if i.importer in members and _owned(i.target, modules) in members - {i.importer}})
    return "cycle " + " <-> ".join(group) + ":\n    " + "\n    ".join(edges)


# -- the rules on rayfleet itself ----------------------------------------------------------------
def test_rayfleet_keeps_its_layering_rules():
    modules, imports = collect_imports(ROOT)
    assert len(modules) > 50, "the checker found too few modules: is ROOT right?"
    broken = rule_violations(modules, imports)
    assert not broken, "layering rules broken:\n" + "\n".join(broken)


def test_rayfleet_has_no_import_cycles():
    modules, imports = collect_imports(ROOT)
    cycles = import_cycles(modules, imports)
    assert not cycles, "\n".join(_describe_cycle(g, imports, modules) for g in cycles)


# -- the checker itself, on a package with deliberately broken imports ---------------------------
def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "rayfleet" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "rayfleet"


CLEAN = {
    "__init__.py": "",
    "errors.py": "",
    "sdk.py": "from rayfleet.jobs import handle\nfrom rayfleet.serving import deployer\n",
    "__main__.py": "from rayfleet.cli import main\n",
    "demo.py": "from rayfleet.models import layers\nfrom rayfleet.storage import tokens\n",
    "cli/__init__.py": "from rayfleet.cli.entry import main\n",
    "cli/entry.py": "def main():\n    from rayfleet.sdk import connect\n",
    "cli/train.py": "def run():\n    from rayfleet.sdk import connect\n    from rayfleet.serving import deployer\n",
    "cli/model.py": "def run():\n    from rayfleet.models import layers\n    from rayfleet.storage import tokens\n",
    "models/__init__.py": "from rayfleet.errors import SpecError\nfrom . import layers\n",
    "models/layers.py": "import torch\n",
    "storage/__init__.py": "",
    "storage/tokens.py": "from rayfleet.errors import SpecError\n",
    "platform/__init__.py": "",
    "platform/connection.py": "import ray\n",
    "jobs/__init__.py": "",
    "jobs/handle.py": "from rayfleet.platform.connection import connect\nfrom rayfleet.models import layers\n",
    "serving/__init__.py": "",
    "serving/deployer.py": "from ..platform import connection\n",
    "serving/engine/__init__.py": "",
    "serving/engine/step.py": "from ...models.layers import x\n",
}


def test_checker_accepts_a_clean_package(tmp_path):
    modules, imports = collect_imports(_write(tmp_path, CLEAN))
    assert "rayfleet.serving.engine.step" in modules
    assert Import("rayfleet.serving.engine.step", "rayfleet.models.layers", 1) in imports  # relative import
    assert rule_violations(modules, imports) == []
    assert import_cycles(modules, imports) == []


@pytest.mark.parametrize("rel, text, rule", [
    ("models/layers.py", "def f():\n    import ray\n", "models never imports Ray"),
    ("models/layers.py", "from rayfleet.storage import tokens\n", "models imports nothing"),
    ("storage/tokens.py", "from rayfleet.models.layers import ByteTokenizer\n", "storage imports nothing"),
    ("jobs/handle.py", "def f():\n    from rayfleet.serving.deployer import deploy\n", "jobs and serving never"),
    ("serving/engine/step.py", "from ...jobs import handle\n", "jobs and serving never"),
    ("platform/connection.py", "from rayfleet.jobs.handle import x\n", "platform imports neither"),
    ("serving/deployer.py", "def f():\n    from rayfleet.sdk import connect\n", "only CLI/SDK/demo"),
    # rule 5 decides by place, not by name: an area's command module is that area's module
    ("storage/model_cli.py", "def run():\n    from rayfleet.models import layers\n", "storage imports nothing"),
    ("jobs/cli.py", "def run():\n    from rayfleet.sdk import connect\n", "only CLI/SDK/demo"),
    ("jobs/cli.py", "def run():\n    from rayfleet.serving import deployer\n", "jobs and serving never"),
    ("platform/queue_cli.py", "def run():\n    from rayfleet.cli import main\n", "only CLI/SDK/demo"),
    ("models/cli.py", "def run():\n    import ray\n", "models never imports Ray"),
])
def test_checker_finds_a_broken_rule(tmp_path, rel, text, rule):
    modules, imports = collect_imports(_write(tmp_path, {**CLEAN, rel: text}))
    broken = rule_violations(modules, imports)
    assert len(broken) == 1 and rule in broken[0], broken


def test_user_facing_glue_lives_in_the_cli_package_only(tmp_path):
    """Glue the CLI package may hold breaks the rules once it sits inside an area, whatever the
    file's name (rule 5 once exempted every ``cli.py``/``*_cli.py``)."""
    glue = "def run():\n    from rayfleet.sdk import connect\n    from rayfleet.models import layers\n"
    modules, imports = collect_imports(_write(tmp_path / "in_cli", {**CLEAN, "cli/model.py": glue}))
    assert rule_violations(modules, imports) == []
    misplaced = {**CLEAN, "storage/model_cli.py": glue, "jobs/cli.py": glue}
    modules, imports = collect_imports(_write(tmp_path / "in_areas", misplaced))
    assert rule_violations(modules, imports) == [
        "rayfleet.jobs.cli:2 -> rayfleet.sdk (only CLI/SDK/demo modules import the SDK, CLI or demo)",
        "rayfleet.storage.model_cli:2 -> rayfleet.sdk (storage imports nothing of rayfleet but errors)",
        "rayfleet.storage.model_cli:3 -> rayfleet.models.layers (storage imports nothing of rayfleet but errors)",
    ]


def test_the_user_facing_layer_is_a_fixed_set_of_places():
    facing = ("rayfleet", "rayfleet.cli", "rayfleet.cli.model", "rayfleet.sdk", "rayfleet.demo", "rayfleet.__main__")
    inside = ("rayfleet.errors", "rayfleet.storage.model_cli", "rayfleet.jobs.cli", "rayfleet.platform.queue_cli",
              "rayfleet.serving.cli", "rayfleet.models.cli", "rayfleet.demo_cli")
    assert all(map(is_user_facing, facing)) and not any(map(is_user_facing, inside))


def test_checker_finds_a_cycle_through_a_lazy_import(tmp_path):
    broken = {**CLEAN, "jobs/launcher.py": "from rayfleet.jobs.elastic import run\n",
              "jobs/elastic.py": "def run():\n    from rayfleet.jobs import worker\n",
              "jobs/worker.py": "from . import launcher\n"}
    modules, imports = collect_imports(_write(tmp_path, broken))
    assert import_cycles(modules, imports) == [["rayfleet.jobs.elastic", "rayfleet.jobs.launcher",
                                                "rayfleet.jobs.worker"]]


# -- rule 7: inside serving, a one-way ladder of rooms --------------------------------------------
# A serving room imports only its own room and rooms of a lower rank (never a sibling of its rank),
# so following a request's imports from ``deployer`` goes down and never climbs back. A room is
# the name under ``rayfleet.serving`` (a subpackage, or a top-level module such as ``spec``); a
# new room must be given a rank here (and a place in docs/architecture.md) before it is used.
SERVING_RANK = {
    "errors": 0, "api_keys": 0, "experts": 0,  # below every room: shared errors, API keys, EPLB
    "engine": 1,  # one replica's engine core; owns what it publishes and the protocols it needs
    "kv": 2, "routing": 2,  # KV tiers and transfer (implement the engine's connector); the router
    "pool_parallelism": 2,  # a pool's wide-EP fields (a mixin of spec's PoolSpec) and their checks
    "pool_queue": 2,  # a pool's queue field (a mixin of spec's PoolSpec) and its admission request
    "spec": 3,  # ServeSpec, the pydantic edge, maps onto engine/routing/experts configs
    "deploy": 4,  # engine replicas on Serve, the request path, Serve autoscaling bounds
    "openai_api": 5, "vllm": 5,  # the two HTTP faces and their Serve applications
    "deployer": 6,  # deploy(spec): picks the app by engine (built-in or vLLM)
    "serve_scaling_shell": 7,  # the shared autoscaler's Serve shell, over what deployer deployed
}


def _serving_room(module: str, package: str = "rayfleet") -> str | None:
    """``rayfleet.serving.engine.x`` -> ``engine``; ``rayfleet.serving.spec`` -> ``spec``; None
    outside serving and for the ``rayfleet.serving`` package itself (its names load lazily)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == [package, "serving"] else None


def serving_ladder_violations(modules: set[str], imports: list[Import], package: str = "rayfleet",
                              rank: dict[str, int] = SERVING_RANK) -> list[str]:
    """Rule 7 broken, as ``importer:line -> target (...)`` lines: an import from a serving room to a
    room of a higher or equal rank other than its own, or a serving room missing from ``rank``."""
    out = [f"{m} (serving room {room!r} has no rank: add it to SERVING_RANK)" for m in modules
           if (room := _serving_room(m, package)) is not None and room not in rank]
    for imp in imports:
        src = _serving_room(imp.importer, package)
        own = _owned(imp.target, modules) if imp.target.split(".")[0] == package else None
        dst = _serving_room(own, package) if own else None
        if src is None or dst is None or src == dst or src not in rank or dst not in rank:
            continue
        if rank[dst] >= rank[src]:
            out.append(f"{imp.importer}:{imp.line} -> {imp.target} (serving room {src} (rank {rank[src]}) "
                       f"imports {dst} (rank {rank[dst]}): a room imports only its own and lower rooms)")
    return sorted(set(out))


def test_serving_is_a_one_way_ladder():
    modules, imports = collect_imports(ROOT)
    rooms = {r for m in modules if (r := _serving_room(m)) is not None}
    assert {"engine", "kv", "routing", "deploy", "openai_api", "vllm"} <= rooms, rooms
    broken = serving_ladder_violations(modules, imports)
    assert not broken, "serving ladder broken:\n" + "\n".join(broken)


LADDER = {
    **CLEAN,
    "serving/errors.py": "",
    "serving/engine/replica_state.py": "from rayfleet.serving.errors import ReplicaError\n",
    "serving/engine/llm.py": "from .replica_state import ReplicaState\n",
    "serving/kv/__init__.py": "",
    "serving/kv/transfer.py": "from rayfleet.serving.engine.replica_state import ReplicaState\n",
    "serving/routing/__init__.py": "",
    "serving/routing/router.py": "from ..engine import replica_state\n",
    "serving/spec.py": "from rayfleet.serving.routing import router\n",
    "serving/deploy/__init__.py": "",
    "serving/deploy/service.py": "from rayfleet.serving.routing.router import Router\nfrom rayfleet.serving import spec\n",
    "serving/openai_api/__init__.py": "",
    "serving/openai_api/app.py": "def build():\n    from rayfleet.serving.deploy.service import Service\n",
    "serving/vllm/__init__.py": "",
    "serving/vllm/app.py": "from rayfleet.serving.deploy import service\n",
    "serving/deployer.py": "def deploy():\n    from rayfleet.serving.openai_api import app\n    from ..vllm import app\n",
}


def test_ladder_checker_accepts_a_clean_ladder(tmp_path):
    modules, imports = collect_imports(_write(tmp_path, LADDER))
    assert serving_ladder_violations(modules, imports) == []
    assert rule_violations(modules, imports) == [] and import_cycles(modules, imports) == []


@pytest.mark.parametrize("rel, text, broken", [
    # the engine climbing to the router that reads its snapshots (issue 26's engine -> routing)
    ("serving/engine/llm.py", "from rayfleet.serving.routing.router import ReplicaSnapshot\n",
     "serving room engine (rank 1) imports routing (rank 2)"),
    # a lazy, relative import climbing two rungs (routing -> deploy)
    ("serving/routing/router.py", "def poll():\n    from ..deploy.service import Client\n",
     "serving room routing (rank 2) imports deploy (rank 4)"),
    ("serving/deploy/service.py", "from rayfleet.serving.vllm import app\n",
     "serving room deploy (rank 4) imports vllm (rank 5)"),
    # siblings of one rank stay apart
    ("serving/openai_api/app.py", "from rayfleet.serving.vllm.app import build\n",
     "serving room openai_api (rank 5) imports vllm (rank 5)"),
    ("serving/kv/transfer.py", "from rayfleet.serving.routing import router\n",
     "serving room kv (rank 2) imports routing (rank 2)"),
    # a room nobody placed on the ladder
    ("serving/cache/pool.py", "from rayfleet.serving.engine import llm\n", "serving room 'cache' has no rank"),
])
def test_ladder_checker_finds_a_room_climbing(tmp_path, rel, text, broken):
    modules, imports = collect_imports(_write(tmp_path, {**LADDER, rel: text}))
    found = serving_ladder_violations(modules, imports)
    assert len(found) == 1 and broken in found[0], found
