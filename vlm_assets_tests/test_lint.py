"""The lint stage of scripts/test.sh (= .ci/run) fails on what it is there to catch: a broken layer
contract and a lint error, each on a copy of the package with one bad line added; and every docstring
opens its function, before any comment."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "vlm_assets", tmp_path / "vlm_assets", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the copy, ahead of the editable install
    return subprocess.run(
        [BIN / "lint-imports", "--no-logo", "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_layer_contracts_hold_and_a_broken_one_is_named(tmp_path):
    root = _copy(tmp_path)
    assert _lint_imports(root).returncode == 0
    engine = root / "vlm_assets" / "data" / "occlusion.py"
    engine.write_text(engine.read_text() + "\nimport dagster  # an engine that reaches up\n")
    models = root / "vlm_assets" / "models" / "gpt.py"
    models.write_text(models.read_text() + "\nfrom vlm_assets.train import gpt_module  # a layer pointing up\n")
    broken = _lint_imports(root)
    assert broken.returncode != 0
    assert (
        "engines import no dagster BROKEN" in broken.stdout and "vlm_assets.data.occlusion -> dagster" in broken.stdout
    )
    assert "layers point down BROKEN" in broken.stdout
    assert "vlm_assets.models.gpt -> vlm_assets.train.gpt_module" in broken.stdout, broken.stdout


def test_ruff_passes_on_the_tree_and_fails_on_an_unused_import(tmp_path):
    assert subprocess.run([BIN / "ruff", "check", "--quiet", "."], cwd=REPO).returncode == 0
    assert subprocess.run([BIN / "ruff", "format", "--check", "--quiet", "."], cwd=REPO).returncode == 0
    root = _copy(tmp_path)
    bad = root / "vlm_assets" / "paths.py"
    lines = bad.read_text().count("\n")
    bad.write_text(bad.read_text() + "\n\ndef unused():\n    import json\n")
    lint = subprocess.run(
        [BIN / "ruff", "check", "--output-format", "concise", "."], cwd=root, capture_output=True, text=True
    )
    assert lint.returncode != 0 and f"vlm_assets/paths.py:{lines + 4}:12: F401" in lint.stdout, lint.stdout
    bad.write_text(bad.read_text().replace("    import json\n", "    import json;x=1\n"))
    assert subprocess.run([BIN / "ruff", "format", "--check", "--quiet", "."], cwd=root).returncode != 0


def _comments_above_docstrings(root: Path) -> list[str]:
    """Every function or class whose body opens with a comment and then its docstring, as path:line."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and ast.get_docstring(node):
                at = node.body[0].lineno
                above = lines[at - 2].strip()  # the line right above the docstring
                if at > node.lineno + 1 and above.startswith("#"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_a_docstring_opens_its_function_before_any_comment(tmp_path):
    """The one-line contract comes first; a comment placed above it reads as the function's summary."""
    for package in ("vlm_assets", "vlm_assets_tests", "bench", "scripts"):
        assert _comments_above_docstrings(REPO / package) == [], package
    bad = tmp_path / "bad.py"
    bad.write_text(
        'def f():\n    # why\n    """Contract."""\n    return 1\n\n\n'
        '@staticmethod\ndef g(\n    x,\n):\n    """Contract."""\n\n\n'
        '# a comment above a one-line function\ndef h(): """Contract."""\n'
    )
    assert _comments_above_docstrings(tmp_path) == ["bad.py:1"]
