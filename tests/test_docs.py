"""Every ```python block of docs/*.md runs as written.

A block is a script. One whose first line says ``# N processes: python -m zerobubble.launch -n N
this.py`` runs as N ranks under the local launcher (:func:`zerobubble.runtime.launcher.launch`);
any other runs as one process without a distributed environment, as ``python this.py`` would.
The blocks of one rank count run in one job, one after another in file order: each rank runs
each block with :func:`runpy.run_path` (as ``__main__``, in a fresh namespace: a block has only
the names it imports itself), in a folder of its own (the files it writes stay apart). The ranks
are forked from a server that imported torch, zerobubble and transformers once, as
tests/ranks.py does: a rank importing them itself takes 10-20 s of the 2-core machine. The
first block that raises, on any rank, fails its job and the test, which names it. The blocks
assert what the prose around them claims; the test checks that they ran.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import runpy
from dataclasses import dataclass
from pathlib import Path

import pytest

from ranks import PRELOAD
from zerobubble.runtime import progress
from zerobubble.runtime.launcher import LaunchError, launch

ROOT = Path(__file__).resolve().parents[1]
RANKS = re.compile(r"# (\d+) processes: python -m zerobubble\.launch -n (\d+) this\.py")
TORCHRUN_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_USE_AGENT_STORE",
    progress.ENV,
)


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    code: str

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def ranks(self) -> int:
        """N for a block that says it runs as N processes, 0 for one plain process."""
        found = RANKS.fullmatch(self.code.split("\n", 1)[0])
        return int(found.group(1)) if found else 0


def fences(text: str) -> list[tuple[int, str, str]]:
    """Every fenced block of a markdown text: (line of its opening fence, info string, body)."""
    out, opened, body = [], None, []
    for number, line in enumerate(text.splitlines(), 1):
        if opened is None and line.lstrip().startswith("```"):
            opened, body = (number, line.lstrip()[3:].strip()), []
        elif opened is not None and line.strip() == "```":
            out.append((*opened, "".join(body)))
            opened = None
        elif opened is not None:
            body.append(line + "\n")
    assert opened is None, f"a fence opened on line {opened[0]} is never closed"
    return out


def doc_blocks() -> list[Block]:
    """The ```python blocks of docs/*.md, in file order."""
    blocks = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for line, info, body in fences(path.read_text()):
            assert info == "python" or not info.lower().startswith("py"), (
                f"docs/{path.name}:{line} opens a ```{info} block: spell it ```python (then it "
                "runs as written) or make it ```text"
            )
            if info == "python":
                blocks.append(Block(path.name, line, body))
    return blocks


def run_on_rank(scripts: list[tuple[str, str]], plain: bool) -> list[str]:
    """One rank of a job: run every ``(name, path)`` script in its own folder, in order;
    returns the names of those that ran to their end."""
    if plain:  # one process, as `python this.py`: no torchrun environment
        for key in TORCHRUN_ENV:
            os.environ.pop(key, None)
    ran = []
    for name, path in scripts:
        os.chdir(os.path.dirname(path))
        try:
            runpy.run_path(path, run_name="__main__")
        except BaseException as e:
            rank = os.environ.get("RANK", "0")
            raise RuntimeError(f"docs block {name} failed on rank {rank}") from e
        ran.append(name)
    return ran


def run_blocks(blocks: list[Block], ranks: int, folder: Path) -> list[list[str]]:
    """Run ``blocks`` as one job of ``ranks`` processes (0: one plain process); returns each
    rank's list of the blocks it ran (:class:`LaunchError` if one raised)."""
    scripts = []
    for block in blocks:
        stem = f"{Path(block.doc).stem}_{block.line}"  # tracebacks name the doc and the line
        path = folder / stem / f"{stem}.py"
        path.parent.mkdir()
        path.write_text(block.code)
        scripts.append((block.name, str(path)))
    # No effect once this process's server runs (then the ranks import transformers).
    multiprocessing.set_forkserver_preload([*PRELOAD, "zerobubble.pipeline", "transformers"])
    return launch(
        run_on_rank,
        max(ranks, 1),
        scripts,
        ranks == 0,
        start_method="forkserver",
        timeout=240,
    )


def test_the_docs_have_python_blocks_and_each_says_how_it_runs():
    blocks = doc_blocks()
    assert len(blocks) >= 13
    for block in blocks:
        lines = block.code.splitlines()
        if any(re.match(r"# \d+ process", line) for line in lines[1:]):
            pytest.fail(f"{block.name}: the rank count goes on the block's first line")
        first = RANKS.fullmatch(lines[0])
        if first:
            assert first.group(1) == first.group(2), f"{block.name}: two rank counts"
            assert int(first.group(1)) >= 1, block.name
        elif "init_distributed(" in block.code:
            pytest.fail(f"{block.name} calls init_distributed but does not say its rank count")


def groups() -> list[int]:
    return sorted({b.ranks for b in doc_blocks()})


def by_ranks(counts: list[int]) -> list:
    """pytest params of rank counts; those of several processes are marked slow."""
    return [pytest.param(n, marks=[pytest.mark.slow] if n else []) for n in counts]


@pytest.mark.parametrize("ranks", by_ranks(groups()))
def test_docs_blocks_run_as_written(ranks, tmp_path):
    """The blocks of one rank count, in one job (one plain process for ``ranks == 0``)."""
    blocks = [b for b in doc_blocks() if b.ranks == ranks]
    ran = run_blocks(blocks, ranks, tmp_path)
    assert ran == [[b.name for b in blocks]] * max(ranks, 1)


@pytest.mark.parametrize("ranks", by_ranks([0, 2]))
def test_a_block_that_raises_fails_the_job_and_is_named(ranks, tmp_path):
    """On one rank of one, or of two; the blocks after it do not run there."""
    blocks = [
        Block("made-up.md", 1, "from pathlib import Path\nPath('ran').touch()\n"),
        Block("made-up.md", 7, "import os\nassert os.environ.get('RANK') == '0'\n"),
        Block("made-up.md", 20, "from pathlib import Path\nPath('ran').touch()\n"),
    ]
    rank = 1 if ranks else 0
    with pytest.raises(LaunchError, match=rf"docs block made-up\.md:7 failed on rank {rank}"):
        run_blocks(blocks, ranks, tmp_path)
    assert (tmp_path / "made-up_1" / "ran").exists()
    assert (tmp_path / "made-up_20" / "ran").exists() == (ranks == 2)  # rank 0 went on
