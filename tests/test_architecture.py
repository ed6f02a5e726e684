"""The package order (docs/architecture.md): ttype -> ops -> codegen -> tuner -> cache -> nn -> fusion ->
integration.  Every import in every module of a package, at module level or inside a function, is read from the
source (ast) and must name the package itself or one below it."""

import ast
from pathlib import Path

import bitkern

ORDER = {"ttype": 0, "ops": 1, "codegen": 2, "tuner": 3, "cache": 4, "nn": 5, "fusion": 6, "integration": 7}


def imported_packages(path: Path, package_root: Path) -> set[tuple[str, int]]:
    """(bitkern package, line) of every import in the module at `path` (relative imports resolved)."""
    package = ("bitkern", *path.relative_to(package_root).parts[:-1])  # what relative imports start from
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            target = base + (node.module.split(".") if node.module else [])
            names = [target + [alias.name] for alias in node.names] if not node.module else [target]
        else:
            continue
        for name in names:
            if name[0] == "bitkern" and len(name) > 1 and name[1] in ORDER:
                found.add((name[1], node.lineno))
    return found


def violations(package_root: Path) -> list[str]:
    """Each import that names a package above the importing one."""
    found = []
    for package, level in ORDER.items():
        for path in sorted((package_root / package).rglob("*.py")):
            for imported, line in sorted(imported_packages(path, package_root)):
                if ORDER[imported] > level or (ORDER[imported] == level and imported != package):
                    found.append(f"{path.relative_to(package_root)}:{line} ({package}) imports {imported}")
    return found


def test_every_package_imports_only_packages_below_it():
    root = Path(bitkern.__file__).resolve().parent
    assert (root / "integration").is_dir(), "bitkern/integration (the link to integration/) is missing"
    assert violations(root) == []


def test_the_check_finds_an_import_of_a_higher_package(tmp_path):
    """The check itself: in a tree whose ops imports the tuner (inside a function, relatively) and whose codegen
    imports nn, both are found, and an import of a lower package is not."""
    for package in ORDER:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "ops" / "matmul.py").write_text("from ..ttype import get\n\ndef run():\n    from ..tuner import tune\n")
    (tmp_path / "codegen" / "cpu").mkdir()
    (tmp_path / "codegen" / "cpu" / "amx.py").write_text("import bitkern.nn.library\nfrom ... import ops\n")
    (tmp_path / "nn" / "linear.py").write_text("from bitkern.cache import kernel_for\n")
    assert violations(tmp_path) == ["ops/matmul.py:4 (ops) imports tuner",
                                    "codegen/cpu/amx.py:1 (codegen) imports nn"]
