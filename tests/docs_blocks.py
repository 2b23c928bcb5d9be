"""The ```python blocks of README.md and docs/*.md, with their docs-test directives.

Read by tests/test_docs.py (the conventions are documented there and in CONTRIBUTING.md). Run as
a script under torchrun, it executes the ``distributed`` blocks of each file given, file after
file, in every worker:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/docs_blocks.py FILE.md...

With ``--report DIR``, each worker writes ``DIR/rank<N>.json`` after every file: the file's
outcome (``"ok"`` or the traceback). The first failure ends the worker (the others may wait in a
collective it will never join; torchrun stops them), so later files are absent from the reports.
"""

from __future__ import annotations

import doctest
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

ROOT = Path(__file__).resolve().parent.parent
MODES = ("cpu", "cuda", "distributed", "skip")
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*(-->)?\s*$")


class DocsFormatError(ValueError):
    """A docs-test directive that cannot be read, or one that belongs to no python block."""


@dataclass(frozen=True)
class Block:
    """One ```python block: its code, where it is, how the docs test runs it."""

    path: str  # relative to the repository root
    index: int  # 1-based among the file's python blocks
    line: int  # line of the block's first code line in the file, 1-based
    code: str
    mode: str = "cpu"  # one of MODES
    reason: str = ""  # for mode "skip"
    setup: str = ""  # hidden code run just before the block, in the same namespace
    setup_line: int = 0

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line} (python block {self.index})"

    @property
    def is_doctest(self) -> bool:
        """A block written as an interactive session (``>>>``): its printed output is checked."""
        return self.code.lstrip().startswith(">>>")


def doc_files() -> list[Path]:
    """Every page the docs test reads: README.md and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def parse(path: Path) -> list[Block]:
    """The python blocks of one markdown file, with the directives written right before each."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: dict[str, object] = {}
    pending_line = 0
    i = 0
    while i < len(lines):
        text = lines[i]
        directive = _DIRECTIVE.match(text)
        fence = _FENCE.match(text)
        if directive:
            name, rest, closed = directive.groups()
            if name == "setup":
                if closed or rest:
                    raise DocsFormatError(
                        f"{rel}:{i + 1}: write setup code on the lines after "
                        "'<!-- docs-test: setup', closed by '-->' on a line of its own"
                    )
                end = i + 1
                while end < len(lines) and lines[end].strip() != "-->":
                    end += 1
                if end == len(lines):
                    raise DocsFormatError(f"{rel}:{i + 1}: setup comment is never closed ('-->')")
                pending["setup"] = "\n".join(lines[i + 1 : end]) + "\n"
                pending["setup_line"] = i + 2
                i = end
            elif name in ("cuda", "distributed", "skip"):
                if not closed:
                    raise DocsFormatError(f"{rel}:{i + 1}: close the directive on its line: -->")
                if name == "skip" and not rest:
                    raise DocsFormatError(f"{rel}:{i + 1}: 'docs-test: skip' needs a reason")
                if "mode" in pending:
                    raise DocsFormatError(f"{rel}:{i + 1}: two modes for one block")
                pending["mode"], pending["reason"] = name, rest
            else:
                raise DocsFormatError(
                    f"{rel}:{i + 1}: unknown docs-test directive {name!r}; valid: setup, cuda, "
                    "distributed, skip <reason>"
                )
            pending_line = pending_line or i + 1
        elif fence:
            indent, lang = fence.groups()
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith("```"):
                end += 1
            if lang in ("py", "pycon", "python3"):
                raise DocsFormatError(f"{rel}:{i + 1}: write ```python, not ```{lang}")
            if lang == "python":
                if indent:
                    raise DocsFormatError(f"{rel}:{i + 1}: an indented ```python block")
                blocks.append(
                    Block(
                        rel,
                        len(blocks) + 1,
                        i + 2,
                        "\n".join(lines[i + 1 : end]) + "\n",
                        **pending,  # type: ignore[arg-type]
                    )
                )
            elif pending:
                raise DocsFormatError(f"{rel}:{pending_line}: directive before a ```{lang} block")
            pending, pending_line = {}, 0
            i = end
        elif pending and text.strip():
            raise DocsFormatError(
                f"{rel}:{pending_line}: a docs-test directive must stand right before its "
                "```python block (blank lines only between them)"
            )
        i += 1
    if pending:
        raise DocsFormatError(f"{rel}:{pending_line}: directive after the last python block")
    return blocks


def _code(source: str, path: str, line: int):
    """Compiled so that tracebacks name the markdown file and its line numbers."""
    return compile("\n" * (line - 1) + source, path, "exec")


def run_block(block: Block, namespace: dict) -> None:
    """Run a block's setup, then the block, in `namespace` (a doctest block checks its output)."""
    if block.setup:
        exec(_code(block.setup, block.path, block.setup_line), namespace)
    if block.is_doctest:
        test = doctest.DocTestParser().get_doctest(
            block.code, namespace, block.where, block.path, block.line - 1
        )
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        runner = doctest.DocTestRunner(optionflags=flags)
        out: list[str] = []
        result = runner.run(test, out=out.append, clear_globs=False)
        if result.failed:
            raise AssertionError("".join(out))
        return
    exec(_code(block.code, block.path, block.line), namespace)


def _run_distributed(path: Path) -> None:
    """A torchrun worker: this file's distributed blocks, in order, in one namespace (the
    process group, if the blocks made one, is destroyed at the end)."""
    namespace: dict = {"__name__": "__main__"}
    try:
        for block in parse(path):
            if block.mode == "distributed":
                run_block(block, namespace)
    finally:
        import gc

        import torch.distributed as dist

        # The blocks' objects (a DDP model's reducer holds the gloo group) go while the group
        # exists and this thread can still give up the GIL: a group destroyed later, by the
        # namespace's own deallocation, waits on gloo's worker thread, which waits for the GIL
        # (a deadlock seen in a full run).
        namespace.clear()
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _agent_store() -> TCPStore | None:
    """A client of torchrun's store, or None outside torchrun (a world of one)."""
    import os
    from datetime import timedelta

    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timedelta(seconds=120))  # fmt: skip


def _fresh_rendezvous(agent: TCPStore, key: str, leader: bool) -> None:
    """Point this page's ``init_process_group`` at a store of its own, hosted by rank 0.

    torchrun's store outlives a destroyed process group, and a group made again in the same
    processes rendezvouses under the same keys: a rank could read its peer's address from the
    previous page's group and connect to a closed socket (gloo: "Connection reset by peer", in 2
    runs of 3). Rank 0 picks a free port (closed again before its store binds it: another
    process could take it in between, a failure that names the port) and tells the others
    through torchrun's store.
    """
    import os
    import socket

    if leader:
        with socket.socket() as sock:
            sock.bind((os.environ["MASTER_ADDR"], 0))
            port = sock.getsockname()[1]
        agent.set(key, str(port))
    os.environ["MASTER_PORT"] = agent.get(key).decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def _run_files(paths: list[Path], report: Path | None) -> int:
    """Each file's distributed blocks in a directory of its own, in order; 1 at the first failure.

    One launch for every page: the workers' start (torch and mixprec imported, a gloo group
    made) cost 12 s of wall clock a page on 2 cores, the blocks themselves under 1 s each.
    """
    import json
    import os
    import traceback

    rank = os.environ.get("RANK", "0")
    outcomes: dict[str, str] = {}
    base = Path.cwd()
    agent = _agent_store()
    for i, path in enumerate(paths):
        work = base / f"{i}-{path.stem}"
        work.mkdir(exist_ok=True)
        os.chdir(work)  # a page's files (checkpoints) never meet another page's
        try:
            if agent is not None:
                _fresh_rendezvous(agent, f"mixprec-docs/{i}", rank == "0")
            _run_distributed(path)
            outcomes[str(path)] = "ok"
        except BaseException:
            outcomes[str(path)] = traceback.format_exc()
        finally:
            os.chdir(base)
        if report is not None:
            (report / f"rank{rank}.json").write_text(json.dumps(outcomes))
        if outcomes[str(path)] != "ok":
            print(f"rank {rank}: {path} failed:\n{outcomes[str(path)]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    report_dir = None
    if args[:1] == ["--report"]:
        report_dir, args = Path(args[1]), args[2:]
    sys.exit(_run_files([Path(a).resolve() for a in args], report_dir))
