"""The shape of the package: imports run one way, public surfaces are deliberate."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path
from types import ModuleType

import pytest

import stalwart

PACKAGE = Path(stalwart.__file__).parent

# what each part may import from stalwart (errors is the shared leaf)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "clock": set(),
    "ids": set(),
    "backoff": set(),
    "config": {"errors"},
    "events": {"errors"},
    "state": {"errors", "events", "backoff"},
    "store": {"errors", "events", "state", "clock", "ids", "config"},
    "providers": {"errors", "events", "state", "clock", "ids", "config", "backoff"},
    "context": {"errors", "events", "state", "clock", "ids", "config"},
    "channels": {"errors", "events", "clock", "ids", "config", "backoff"},
    "tools": {"errors", "events", "state", "clock", "ids", "config"},
    "actors": {
        "errors",
        "events",
        "state",
        "clock",
        "ids",
        "config",
        "store",
        "providers",
        "context",
        "channels",
        "tools",
        "backoff",
    },
    "testing": {
        "errors",
        "events",
        "state",
        "clock",
        "ids",
        "config",
        "store",
        "providers",
        "context",
        "channels",
        "tools",
        "backoff",
    },
    "runtime": {
        "errors",
        "events",
        "state",
        "clock",
        "ids",
        "config",
        "store",
        "providers",
        "context",
        "channels",
        "tools",
        "actors",
        "backoff",
    },
}
#: logging (``stalwart._logs``) and terminal-safe text (``stalwart._text``) are
#: foundations like errors: every part may use them
ALLOWED["_logs"] = set()
ALLOWED["_text"] = set()
for _rules in ALLOWED.values():
    _rules.update(("_logs", "_text"))
#: the anyio patterns the I/O layers share (``stalwart._aio``), on a Clock's timers
ALLOWED["_aio"] = {"clock"}
for _part_name in ("channels", "tools", "actors", "testing", "runtime"):
    ALLOWED[_part_name].add("_aio")


def _part(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def _imported_parts(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    package = ".".join(("stalwart", *path.relative_to(PACKAGE).parent.parts))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names = [f"{base}.{node.module}" if node.module else base]
                if not node.module:
                    names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                names = [node.module or ""]
                if node.module == "stalwart":
                    names = [f"stalwart.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "stalwart" and len(parts) > 1:
                found.add(parts[1])
    return found


SOURCES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_one_way(path: Path) -> None:
    part = _part(path)
    if part in {"cli", "__init__", "__main__", "_entry"}:
        return  # the top: may use anything
    allowed = ALLOWED.get(part)
    assert allowed is not None, f"{part} is a new part: add it to ALLOWED with its rule"
    upward = _imported_parts(path) - allowed - {part}
    assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)} against the layering"


def _subpackages() -> list[ModuleType]:
    return [
        importlib.import_module(f"stalwart.{info.name}")
        for info in pkgutil.iter_modules([str(PACKAGE)])
        if info.ispkg
    ]


@pytest.mark.parametrize("module", _subpackages(), ids=lambda m: m.__name__)
def test_public_surface_is_declared(module: ModuleType) -> None:
    declared = getattr(module, "__all__", None)
    assert declared is not None, f"{module.__name__} has no __all__"
    assert len(declared) == len(set(declared)), "duplicates in __all__"
    for name in declared:
        assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name}"
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, ModuleType)
    }
    assert public - set(declared) == set(), f"{module.__name__} exports names not in __all__"


def test_private_modules_are_underscored() -> None:
    for path in SOURCES:
        relative = path.relative_to(PACKAGE)
        if len(relative.parts) > 1 and relative.parts[0] != "cli":
            assert relative.name.startswith("_"), f"{relative}: implementation modules are _private"


def test_typed_marker_ships() -> None:
    assert (PACKAGE / "py.typed").exists()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_clock_reads_time_and_only_ids_makes_ids(path: Path) -> None:
    text = path.read_text()
    name = path.relative_to(PACKAGE).as_posix()
    if name != "clock.py":
        for banned in ("time.time(", "time.monotonic(", "datetime.now(", "perf_counter("):
            assert banned not in text, f"{name} reads the clock directly ({banned})"
    if name != "ids.py":
        assert "uuid4(" not in text, f"{name} makes ids directly"
