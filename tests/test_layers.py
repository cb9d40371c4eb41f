"""The package's layers (docs/architecture.md) hold: pyproject.toml's import-linter contracts pass on the
code, and fail on a copy of it given one import that runs back up or makes a circle."""

import os
import shutil
import subprocess
import sys

import pytest

import helixtok

pytest.importorskip("importlinter")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(helixtok.__file__)))


def lint(root):
    """lint-imports over the package found under `root`, with `root`'s pyproject.toml: (exit code, output)."""
    env = {**os.environ, "PYTHONPATH": root}
    p = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                        "sys.exit(lint_imports_command())", os.path.join(root, "pyproject.toml"),
                        "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def test_contracts_hold():
    rc, out = lint(ROOT)
    assert rc == 0, out
    assert "Contracts: 2 kept, 0 broken." in out


@pytest.mark.parametrize("module, line, says", [
    # a training node importing the build's machinery
    ("read/stats.py", "from ..pipeline import config  # noqa",
     "helixtok.read is not allowed to import helixtok.pipeline"),
    # the on-disk format importing the reader above it
    ("format/manifest.py", "from ..read import layout  # noqa",
     "helixtok.format is not allowed to import helixtok.read"),
    # two modules of one folder importing each other (unit imports journal)
    ("pipeline/journal.py", "from . import unit  # noqa", "No cycles are allowed in helixtok.pipeline"),
])
def test_a_wrong_import_breaks_a_contract(tmp_path, module, line, says):
    shutil.copytree(os.path.join(ROOT, "helixtok"), tmp_path / "helixtok",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    with open(tmp_path / "helixtok" / module, "a") as fh:
        fh.write(f"\n{line}\n")
    rc, out = lint(str(tmp_path))
    assert rc == 1, out
    assert says in out, out


def test_the_map_names_every_module():
    """docs/architecture.md places every module: a module added without a line there fails here."""
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as fh:
        text = fh.read()
    missing = []
    pkg = os.path.join(ROOT, "helixtok")
    folders = sorted(f for f in os.listdir(pkg) if os.path.isfile(os.path.join(pkg, f, "__init__.py")))
    assert {"cli", "pipeline", "read", "format", "repacking"} <= set(folders)
    for folder in folders:
        for name in sorted(os.listdir(os.path.join(ROOT, "helixtok", folder))):
            if name.endswith(".py") and not name.startswith("__") and f"`{name}`" not in text \
                    and f"`{folder}/{name}`" not in text:
                missing.append(f"{folder}/{name}")
    assert not missing, f"docs/architecture.md does not place {missing}"
