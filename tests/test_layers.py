"""The package's layers (``.importlinter``, drawn in docs/ARCHITECTURE.md): every import points
down a layer and no modules of one package import each other in a loop, checked by import-linter
over the code as it stands; a module the layers do not place fails too, and a control package
with an upward import shows the check does fail."""
import configparser
import os
import pkgutil
import shutil
import subprocess
import sys
import textwrap

import stree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, ".importlinter")


def lint(config: str, cwd: str) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    return subprocess.run([exe, "--config", config, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": cwd})


def test_imports_point_down_the_layers():
    proc = lint(CONFIG, REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout


def test_every_module_has_a_layer():
    """A new module must be placed in the layers (an unplaced one is not checked at all)."""
    cfg = configparser.ConfigParser()
    cfg.read(CONFIG)
    placed = {name.strip() for line in cfg["importlinter:contract:layers"]["layers"].splitlines()
              for name in line.split("|") if name.strip()}
    modules = {f"stree.{m.name}" for m in pkgutil.iter_modules(stree.__path__)}
    assert modules == placed, f"not placed: {sorted(modules - placed)}; gone: {sorted(placed - modules)}"


def test_an_upward_import_is_caught(tmp_path):
    """The control: a package whose lower layer imports the upper one breaks the contract."""
    pkg = tmp_path / "house"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("from house import ground\n")
    (pkg / "ground.py").write_text("from house import top\n")  # up, and a loop
    config = tmp_path / "contracts.ini"
    config.write_text(textwrap.dedent("""\
        [importlinter]
        root_package = house

        [importlinter:contract:layers]
        name = layers
        type = layers
        layers =
            house.top
            house.ground
        """))
    proc = lint(str(config), str(tmp_path))
    assert proc.returncode != 0 and "BROKEN" in proc.stdout and "house.ground -> house.top" in proc.stdout
