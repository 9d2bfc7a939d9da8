"""The kvcli package imports downward only: no import circle, counting the
imports inside functions as well as those at module level.

The graph is built from the source with `ast`, so an import that runs only
on some path (inside a function, under `if`, in `try`) counts like any other.
Relative imports are resolved, and `from kvcli.x import y` counts as an import
of `kvcli.x.y` when y is a submodule (otherwise of `kvcli.x`).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import kvcli

PACKAGE = Path(kvcli.__file__).resolve().parent


def module_names() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` inside `module`."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest module of the package that `name` is or lies inside."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the kvcli modules it imports anywhere in its source."""
    modules = module_names()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                # `from a import b`: b is a submodule or a name inside a.
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                owner = _owner(target, modules)
                if owner is not None and owner != module:
                    edges.add(owner)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == 1:
                return path[path.index(succ):] + [succ]
            if succ not in state:
                found = visit(succ)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_resolution_of_relative_and_submodule_imports():
    graph = import_graph()
    # `from kvcli import policies` and `from kvcli.native import cache` name submodules; `from kvcli.errors
    # import KvcliError` a name inside one.
    assert ({"kvcli.planning.planner", "kvcli.policies", "kvcli.errors"}
            <= graph["kvcli.drivers.check.levels"] | graph["kvcli.planning.planner"])
    assert "kvcli.native.cache" in graph["kvcli.engines"]
    assert _resolve("kvcli.reference.policies", True, 3, "policies.base") == "kvcli.policies.base"
    assert _resolve("kvcli.reference.compact", False, 1, "session") == "kvcli.reference.session"
    assert _resolve("kvcli.reference.compact", False, 2, None) == "kvcli"
    assert _owner("kvcli.commands.run.main", module_names()) == "kvcli.commands.run"


def test_find_cycle_reports_the_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_kvcli():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# The layers of the package, lowest first: a module imports its own layer and the ones before it only
# (docs/internals.md, "Module layers"). A module is in the layer of its longest listed prefix.
LAYERS = [
    ("foundation", ["kvcli", "kvcli.errors", "kvcli.config", "kvcli.planning.formats", "kvcli.planning.rope",
                    "kvcli.session", "kvcli.catalogue", "kvcli.models", "kvcli.doc_formats",
                    "kvcli.templating", "kvcli.documents", "kvcli.outfile", "kvcli.document_store", "kvcli.taskclass",
                    "kvcli.evaluation", "kvcli.evaluation.logbook", "kvcli.evaluation.report", "kvcli.testing",
                    "kvcli.evaluation.corpus", "kvcli.evaluation.questions",
                    "kvcli.native.build"]),
    ("policies", ["kvcli.policies"]),
    ("engines", ["kvcli.native", "kvcli.reference", "kvcli.engines", "kvcli.generate", "kvcli.kvc",
                 "kvcli.evaluation.measure", "kvcli.citations"]),
    ("calibration", ["kvcli.calibration"]),
    ("planning", ["kvcli.planning"]),
    ("drivers", ["kvcli.drivers", "kvcli.evaluation.runner", "kvcli.evaluation.tasks", "kvcli.evaluation.chat",
                 "kvcli.evaluation.fidelity", "kvcli.evaluation.fidelity_reselect", "kvcli.evaluation.corpus_eval",
                 "kvcli.evaluation.corpus_reselect", "kvcli.evaluation.evidence"]),
    ("app", ["kvcli.apps"]),
    # the fuzzer drives the command line; a calibration's commands take the shared flags
    ("commands", ["kvcli.commands", "kvcli.cli", "kvcli.testing.fuzz", "kvcli.calibration.command"]),
]


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"{module} is in no layer: add it to LAYERS"
    return rank


def test_layers_import_downward_only():
    graph = import_graph()
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
              for m, targets in sorted(graph.items()) for t in sorted(targets) if layer_of(t) > layer_of(m)]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


# Above the engine layer the engines are reached through the Session protocol (kvcli/session.py) and
# kvcli/engines.py (opening a session, one engine's planner, the native engine's capabilities by name, its
# library's identity and state format). These are the only modules outside kvcli.native that import it, and why:
NATIVE_IMPORTERS = {
    "kvcli.engines": "the one place the layers above reach the native engine through",
    "kvcli.generate": "llama.cpp's sampler chain samples for both engines (load_llama_cpp, signals_deferred)",
}


def test_only_the_engine_layer_imports_native():
    graph = import_graph()
    found = {m for m, targets in graph.items() if not (m == "kvcli.native" or m.startswith("kvcli.native."))
             and any(t == "kvcli.native" or t.startswith("kvcli.native.") for t in targets)}
    assert found <= set(NATIVE_IMPORTERS), ("import kvcli.native through kvcli.engines (or name the capability "
                                            "there): " + ", ".join(sorted(found - set(NATIVE_IMPORTERS))))
    assert set(NATIVE_IMPORTERS) <= found, "no longer imports kvcli.native: drop it from NATIVE_IMPORTERS"


# Imported only inside the functions that use them, so that `kvcli --help`, `kvcli policies` and every
# command that does not need them start without them (docs/internals.md, "Module layers").
LAZY = ("torch", "transformers", "gguf", "jinja2", "tqdm", "matplotlib", "ray")


def test_the_command_line_starts_without_the_heavy_dependencies():
    code = ("import sys, kvcli.cli, kvcli.drivers.compress, kvcli.apps.chat, kvcli.drivers.bench, kvcli.drivers.check; "
            f"print(' '.join(m for m in {LAZY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.strip()
    assert out == "", f"imported when the CLI starts: {out}"


def test_a_compresskv_run_reads_its_calibration_without_torch():
    """The calibration side-car is applied with numpy and gguf only: before, resolving compresskv imported the
    calibration tool (torch), 195 MB more peak RSS for `kvcli run --policy compresskv` than for snapkv."""
    code = ("import sys; from kvcli.models import default_model_path; from kvcli.planning.planner import "
            "resolve_for_model; "
            "spec, params = resolve_for_model(default_model_path(), 'compresskv', {}, 128); "
            "print(bool(params.get('layer_scores')), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.split()
    assert out == ["True", "False"], out


# ------------------------------------------------------------------ what is particular to a policy or an engine
# A policy's particulars hang off its PolicySpec (kvcli/policies/<name>.py, docs/development.md, "A policy: its spec
# and its hooks"): the drivers, apps and commands name none of the policies below outside a comment (issue #65's grep).
POLICIES_NAMED_NOWHERE = ("kvzip", "compresskv", "windowkv", "spindlekv", "d2o", "expected_attention", "keydiff",
                          "tova")
ABOVE_THE_POLICIES = ("drivers", "apps", "commands")


def _code_without_comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every token of the file but its comments (strings and docstrings count)."""
    with path.open("rb") as f:
        return [(t.start[0], t.string) for t in tokenize.tokenize(f.readline)
                if t.type not in (tokenize.COMMENT, tokenize.ENCODING)]


def test_no_policy_is_named_above_the_policies():
    pattern = re.compile("|".join(POLICIES_NAMED_NOWHERE))
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text.strip()[:80]}"
             for folder in ABOVE_THE_POLICIES for path in sorted((PACKAGE / folder).rglob("*.py"))
             for line, text in _code_without_comments(path) if pattern.search(text)]
    assert not found, "a policy named outside kvcli/policies (give it a PolicySpec hook):\n" + "\n".join(found)


# An engine is told apart by a capability kvcli/engines.py names (shares_cells, saves_state, cites, ...) or by the
# Session protocol's attributes (kvcli/session.py), never by its name or by probing a session's attributes.
ENGINE_CLIENTS = [PACKAGE / d for d in ABOVE_THE_POLICIES] + [PACKAGE / "citations.py", PACKAGE / "doc_formats.py"]


def _probed(node: ast.AST) -> str | None:
    """The name a session or snapshot is written as in `node` (session, self.session, snap, ...), else None."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name if re.search(r"session|snap", name) or name == "s" else None


def engine_probes(path: Path) -> list[str]:
    """`x.engine == "native"`, getattr/hasattr(session, "name") and session._private in one file's source."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(isinstance(n, ast.Attribute) and n.attr == "engine"
                                                 for n in [node.left, *node.comparators]) \
                and any(isinstance(n, ast.Constant) and n.value in ("native", "reference")
                        for n in [node.left, *node.comparators]):
            out.append(f"{node.lineno}: the engine told by its name")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and _probed(node.args[0]) and isinstance(node.args[1], ast.Constant):
            out.append(f"{node.lineno}: {node.func.id}({_probed(node.args[0])}, {node.args[1].value!r})")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and _probed(node.value):
            out.append(f"{node.lineno}: {_probed(node.value)}.{node.attr}")
    return out


def test_engine_probes_are_found():
    src = ('if session.engine == "native" and hasattr(snap, "state"): x = getattr(self.session, "ctx", None)\n'
           'y = session._slot_origins(0); z = getattr(self._session, name); w = self._session.logits(0)\n')
    path = Path(__file__).with_name("_probe_sample.py")
    try:
        path.write_text(src)
        assert [p.split(": ", 1)[1] for p in engine_probes(path)] == [
            "the engine told by its name", "hasattr(snap, 'state')", "getattr(session, 'ctx')",
            "session._slot_origins"]
    finally:
        path.unlink()


def test_no_engine_is_probed_above_the_engines():
    found = [f"{path.relative_to(PACKAGE.parent)}:{p}" for root in ENGINE_CLIENTS
             for path in sorted(root.rglob("*.py") if root.is_dir() else [root]) for p in engine_probes(path)]
    assert not found, ("ask kvcli/engines.py's named capability or the Session protocol instead:\n"
                       + "\n".join(found))
