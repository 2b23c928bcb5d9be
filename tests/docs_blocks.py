"""The ```python blocks of README.md and docs/*.md, with their docs-test directives.

Read by tests/test_docs.py (the conventions are documented there and in CONTRIBUTING.md). Run as
a script under torchrun, it executes one file's ``distributed`` blocks in every worker:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/docs_blocks.py FILE.md
"""

from __future__ import annotations

import doctest
import re
import sys
from dataclasses import dataclass
from pathlib import Path

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
    """A torchrun worker: this file's distributed blocks, in order, in one namespace."""
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


if __name__ == "__main__":
    _run_distributed(Path(sys.argv[1]).resolve())
