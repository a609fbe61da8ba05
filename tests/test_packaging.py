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
    data_only = {name for name in SETUPTOOLS["package-data"] if not (_folder_of(name) / "__init__.py").exists()}
    listed = set(SETUPTOOLS["packages"])
    assert not found - listed, f"packages pyproject.toml does not list (they would not be installed): {found - listed}"
    assert not listed - found - data_only, (
        f"listed, but neither a package nor a data folder: {listed - found - data_only}"
    )
    assert all(_folder_of(name).is_dir() for name in data_only)


def test_the_data_files_the_code_opens_ship_with_it() -> None:
    data = SETUPTOOLS["package-data"]
    for folder in ("demo", "draft"):  # expertmesh/devtools/tiny/demo_model.py opens both
        package = f"expertmesh.devtools.tiny.{folder}"
        assert package in SETUPTOOLS["packages"] and data[package] == ["*"], folder
        assert any(_folder_of(package).iterdir()), folder
    assert "*.proto" in data["expertmesh.v1"]
