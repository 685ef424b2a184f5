"""The package's layers, as README's "Layout of the code" lists them: every import of a megalite module (lazy ones
inside functions included) goes to a layer listed above the importer's, training starts without Hydra, OmegaConf,
the command line, the planner or anything that draws, and only megalite/visual imports a plotting library."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .helpers import ROOT, launch


def layers() -> list[str]:
    """The README's layer list, lowest first: 'config', 'parallel_state', ..., '__init__'."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout of the code", 1)[1].split("```", 2)[1]
    names = re.findall(r"^megalite/(\w+)", block, flags=re.MULTILINE)
    assert names, "README's Layout of the code lists no layer"
    return names


def _layer_of(module: str) -> str:
    """megalite.config.flags -> config; megalite -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, package: str = "megalite") -> list[tuple[int, str]]:
    """(line, module of ``package``) for every import in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == package]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == package:   # from megalite import parallel_state
                found += [(node.lineno, f"{package}.{a.name}") for a in node.names]
            elif node.module.split(".")[0] == package:
                found.append((node.lineno, node.module))
    return found


def upward_imports() -> list[str]:
    order = {name: rank for rank, name in enumerate(layers())}
    bad = []
    for path in sorted((ROOT / "megalite").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        mine = _layer_of(module)
        assert mine in order, f"{path.relative_to(ROOT)}: its layer {mine!r} is not in README's list"
        for line, target in imports(path):
            theirs = _layer_of(target)
            if theirs != mine and order[theirs] > order[mine]:
                bad.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {target} ({theirs}, a higher layer)")
    return bad


def test_every_import_goes_down_the_layers():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    # The walk itself: an import inside a function, from a low layer to a high one, is found.
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from megalite.training import Trainer\n    from megalite import planner\n")
    assert [target for _, target in imports(sample)] == ["megalite.training", "megalite.planner"]


def test_training_starts_without_hydra_the_command_line_the_planner_or_plotting():
    # (tqdm is not looked for here: torch.hub imports it whenever it is installed.)
    code = ("import sys, megalite.training\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf', 'matplotlib')\n"
            "             or m.startswith(('megalite.planner', 'megalite.config.cli', 'megalite.config.deepspeed',\n"
            "                          'megalite.visual'))))")
    result = launch(["-c", code])
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


PLOTTING = ("matplotlib", "tqdm")


def test_only_the_visual_package_imports_plotting_libraries():
    # Lazy imports included: training (below megalite/visual) can then never load them, whatever path it takes.
    bad = [f"{path.relative_to(ROOT)}:{line} imports {target}"
           for path in sorted((ROOT / "megalite").rglob("*.py")) if "visual" not in path.relative_to(ROOT).parts
           for package in PLOTTING for line, target in imports(path, package)]
    assert bad == []
    sample = ROOT / "megalite" / "visual" / "figures.py"
    assert [target for _, target in imports(sample, "matplotlib")] == ["matplotlib.figure"]
