"""What a user installs: one import namespace, `expertmesh`, with every package and data file the
code opens. pyproject.toml lists the packages by hand (the folders map onto the namespace), so a
new subpackage that is not listed would be missing from the wheel: this test says which."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _folder_of(package: str) -> Path:
    """The folder a package name maps to under the package-dir mapping (the longest prefix wins)."""
    mapping = SETUPTOOLS["package-dir"]
    prefix = max((p for p in mapping if package == p or package.startswith(p + ".")), key=len, default="")
    base = ROOT / mapping[prefix] if prefix else ROOT
    rest = package[len(prefix) :].lstrip(".") if prefix else package
    return base.joinpath(*rest.split(".")) if rest else base


def test_every_package_folder_is_listed_and_every_listed_package_exists() -> None:
    found = set()
    for top in ("expertmesh", "expertmesh.node", "expertmesh.coordinator", "expertmesh.v1"):
        folder = _folder_of(top)
        found |= {".".join((top, *init.parent.relative_to(folder).parts)) for init in folder.rglob("__init__.py")}
    listed = set(SETUPTOOLS["packages"])
    assert not found - listed, f"packages pyproject.toml does not list (they would not be installed): {found - listed}"
    assert not listed - found, f"packages pyproject.toml lists but that have no __init__.py: {listed - found}"


def test_the_data_files_the_code_opens_ship_with_it() -> None:
    data = SETUPTOOLS["package-data"]
    tiny = _folder_of("expertmesh.node.devtools.tiny")
    for folder in ("demo", "draft"):
        assert f"{folder}/*" in data["expertmesh.node.devtools.tiny"], folder
        assert any((tiny / folder).iterdir()), folder
    assert "*.proto" in data["expertmesh.v1"]
