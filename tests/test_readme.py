"""The README's Python section and examples/ run as written and use only ``zerobubble``'s
public names: the schedule block in a torch-free process, the training block as a script
under the local launcher on 3 gloo ranks."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zerobubble

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(zerobubble.__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    """The ```python blocks of the README's "## Python" section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def zerobubble_imports(code: str) -> list[str]:
    """Every module of ours the code imports, as written."""
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "zerobubble"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerobubble"):
            out += [f"{node.module}:{a.name}" for a in node.names]
    return out


def test_readme_has_the_two_blocks_and_they_import_only_zerobubble():
    blocks = python_blocks()
    assert len(blocks) == 2
    for code in blocks:
        assert zerobubble_imports(code) == ["zerobubble"]


def test_examples_import_only_public_names():
    for path in sorted((ROOT / "examples").glob("*.py")):
        for imported in zerobubble_imports(path.read_text()):
            module, _, name = imported.partition(":")
            assert module == "zerobubble", f"{path.name} imports {imported}"
            assert name in ("", *zerobubble.__all__), f"{path.name} imports {imported}"


def test_schedule_block_prints_what_it_says_without_torch():
    code = python_blocks()[0]
    expected = re.search(r"^print\(.*\)\s+# (.*)$", code, flags=re.M).group(1)
    check = "\nimport sys\nassert 'torch' not in sys.modules, 'the schedule block imported torch'\n"
    out = subprocess.run(
        [sys.executable, "-c", code + check],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected == "24 0.0 7"


@pytest.mark.slow
def test_training_block_runs_on_three_ranks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(python_blocks()[1])
    cmd = [sys.executable, "-m", "zerobubble.launch", "-n", "3", "--timeout", "240", str(script)]
    out = subprocess.run(cmd, env=env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"step {i}" for i in range(10)]
    losses = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert losses[-1] < losses[0]  # it trains
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    model_line = re.search(r"^model = (.*)$", python_blocks()[1], flags=re.M).group(1)
    model = eval(model_line, {"nn": nn})  # the README's model, untrained
    assert sorted(k for part in parts for k in part) == sorted(model.state_dict())
