"""Nothing outside kvmemo/engine/ imports the engine's modules or reaches into its parts: the
package's names (kvmemo.engine.__all__) and the Engine's public methods are the whole surface,
the same one an engine in another process would serve."""

from __future__ import annotations

import ast
from pathlib import Path

import kvmemo

PACKAGE = Path(kvmemo.__file__).parent
# Engine / AsyncEngine attributes that are its parts, not its API.
INTERNALS = {"scheduler", "kv_manager", "runner", "kv_connector", "beams", "hasher", "layout",
             "loaded", "engine"}


def offenders(source: str) -> list[str]:
    """Imports of kvmemo.engine.<module>, and <anything>.engine.<part or private name>."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found += [f"{node.lineno}: imports {n}" for n in names if n.startswith("kvmemo.engine.")]
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "engine"
            and (node.attr in INTERNALS or node.attr.startswith("_"))
        ):
            found.append(f"{node.lineno}: uses .engine.{node.attr}")
    return found


def test_nothing_outside_engine_imports_or_reaches_into_it():
    files = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "engine"]
    assert len(files) > 30, "the scan found too few modules to mean anything"
    found = [f"{p.relative_to(PACKAGE)}:{o}" for p in sorted(files) for o in offenders(p.read_text())]
    assert not found, "use kvmemo.engine's names and the Engine's methods:\n" + "\n".join(found)


def test_the_scan_catches_each_kind_of_reach_in():
    source = (
        "from kvmemo.engine.scheduler import Scheduler\n"
        "import kvmemo.engine.model_runner\n"
        "from kvmemo.engine import Engine\n"  # the package's names are fine
        "x = llm.engine.scheduler.waiting\n"
        "y = server.engine.engine.max_model_len\n"
        "z = llm.engine._tracked\n"
        "ok = llm.engine.stats().num_waiting\n"
    )
    assert sorted(offenders(source)) == [
        "1: imports kvmemo.engine.scheduler",
        "2: imports kvmemo.engine.model_runner",
        "4: uses .engine.scheduler",
        "5: uses .engine.engine",
        "6: uses .engine._tracked",
    ]
