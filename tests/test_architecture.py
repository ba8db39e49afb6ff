"""The import graph of the library: layers point down only, no cycles, the application on top.

Each module of ``src/tunefree`` has a layer; a module may import only from its own layer or below, and
nothing below the command line (``tunefree.cli``) may import it. A new module must be given a layer here,
which is the moment to decide where it belongs (docs/architecture.md draws the same picture).
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "tunefree"

LAYERS: dict[str, int] = {
    "errors": 0, "dtypes": 0, "_validate": 0,
    "clipping": 1, "rules": 1, "data": 1, "privacy": 1,
    "persample": 2, "parallel": 2,
    "guards": 3,
    "step": 4,
    "components": 5,
    "config": 6,
    "api": 7, "run": 7, "build": 7, "pipeline": 7,
    "__init__": 8, "extend": 8, "audit": 8, "integrations": 8,
    "cli": 9,
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts)


def _layer(module: str) -> int:
    top = module.split(".")[0]
    if top not in LAYERS:
        raise AssertionError(f"module tunefree.{module} has no layer: add it to LAYERS in {__file__}")
    return LAYERS[top]


def _imports(path: pathlib.Path) -> set[str]:
    """The tunefree modules that ``path`` imports (relative and absolute imports)."""
    package = _module_name(path).split(".")[:-1] if path.name != "__init__.py" else \
        _module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] if node.level > 1 else package
                target = ".".join([*base, node.module] if node.module else base)
            elif node.module and node.module.startswith("tunefree"):
                target = node.module.removeprefix("tunefree").lstrip(".")
            else:
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}" if target else alias.name
                module_file = SRC.joinpath(*candidate.split("."))
                found.add(candidate if module_file.with_suffix(".py").exists() or module_file.is_dir()
                          else target)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("tunefree.") for a in node.names
                      if a.name.startswith("tunefree.")}
    return {m for m in found if m}


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in SRC.rglob("*.py")}


def test_every_import_points_to_the_same_layer_or_below():
    upward = [f"tunefree.{module} → tunefree.{target}" for module, targets in _graph().items()
              for target in targets if _layer(target) > _layer(module)]
    assert upward == []


def test_the_import_graph_has_no_cycles():
    graph = {m: {t.removesuffix(".__init__") for t in ts} for m, ts in _graph().items()}
    graph = {m.removesuffix(".__init__"): ts for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for target in graph.get(node, ()):
            if target == node:
                continue
            if state.get(target) == 1:
                cycle.extend([*path, node, target])
                return True
            if target not in state and visit(target, [*path, node]):
                return True
        state[node] = 2
        return False

    for node in sorted(graph):
        if node not in state and visit(node, []):
            break
    assert cycle == []


# Inside persample/ the engine's parts are layers too: capture, mixed precision and booking are each
# functions of the pass state (units.py, with the other modules at 0), none imports another, and the
# engine's hooks sit on top.
PERSAMPLE_LAYERS = {"capture": 1, "amp": 1, "booking": 1, "engine": 2}


def test_the_engine_parts_import_only_the_pass_state_and_below():
    def level(module: str) -> int:
        return PERSAMPLE_LAYERS.get(module.removeprefix("persample."), 0)

    upward = [f"tunefree.{module} → tunefree.{target}" for module, targets in _graph().items()
              if module.startswith("persample.") for target in targets if target.startswith("persample.")
              and (level(target) > level(module) or level(target) == level(module) > 0)]
    assert upward == []


def test_the_library_never_imports_the_command_line():
    offenders = [m for m, targets in _graph().items() if not m.startswith("cli")
                 and any(t.split(".")[0] == "cli" for t in targets)]
    assert offenders == []


DOC = SRC.parents[1] / "docs" / "architecture.md"


def test_the_architecture_page_names_every_module_and_only_files_that_exist():
    """docs/architecture.md draws the code as built: every library module (outside cli/ and audit/, which
    have their own pages) is named there, and every module path it names exists (``foo.py`` stands for a
    file to add)."""
    page = DOC.read_text()
    unnamed = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
               if p.relative_to(SRC).parts[0] not in ("cli", "audit") and p.name != "__init__.py"
               and p.name not in page]
    assert unnamed == []
    named = set(re.findall(r"[\w./]*\w/[\w/]*\.py", page))
    stale = [p for p in sorted(named) if not p.endswith("/foo.py")
             and not (SRC / p).exists() and not (SRC.parents[1] / p).exists()]
    assert stale == []


@pytest.mark.slow
def test_import_tunefree_leaves_the_heavy_optional_modules_unimported():
    """``import tunefree`` imports neither transformers (the HF rules match it through ``sys.modules``) nor
    torch.distributed.tensor (which brings sympy: a second and ~50 MB; FSDP2 models import it themselves)."""
    code = ("import sys, tunefree; print(sorted(m for m in ('transformers', 'torch.distributed.tensor', "
            "'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# The command line is an application of the public API: it imports names from these modules only, each
# name one of the module's ``__all__`` (``tunefree.audit``, a public package, is reached as ``tunefree``'s).
PUBLIC_MODULES = ("tunefree", "tunefree.extend", "tunefree.privacy")


def _cli_imports(path: pathlib.Path) -> list[tuple[str, str]]:
    """(module, name) of every import of a tunefree module outside cli/ in ``path`` (a module of cli/)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                package = ["tunefree", "cli"]
                module = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module
                                                                              else [])])
            else:
                module = node.module or ""
            if module.startswith("tunefree") and not module.startswith("tunefree.cli"):
                found += [(module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names
                      if alias.name.startswith("tunefree") and not alias.name.startswith("tunefree.cli")]
    return found


def test_the_command_line_imports_only_the_public_api():
    import importlib

    public = {name: set(importlib.import_module(name).__all__) for name in PUBLIC_MODULES}
    offenders = [f"cli/{path.name}: {module} {name}".strip()
                 for path in sorted((SRC / "cli").glob("*.py"))
                 for module, name in _cli_imports(path)
                 if module not in public or (name and name not in public[module])]
    assert offenders == []
