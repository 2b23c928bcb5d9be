"""Every ```python block of README.md and docs/*.md runs as written.

How the blocks run (for contributors: CONTRIBUTING.md says the same):

- Each file's blocks run in order in one namespace, like a notebook, on the CPU, in a temporary
  working directory (files a block writes go there). Nothing is imported for them: a file's
  first block imports what it uses, or its setup does.
- A block written as an interactive session (lines starting with ``>>>``) runs as a doctest:
  its printed output must match (``...`` matches anything).
- HTML comments written right before a block (blank lines only between) tell the test more.
  They do not show on a rendered page:

  ``<!-- docs-test: setup`` + code lines + ``-->``
      hidden code run just before the block, in the same namespace: the block's inputs (a
      model, a loader, a loss function) defined in a few lines, so that the block itself shows
      only what it teaches. Keep it small and honest: it may not change what the block does.
  ``<!-- docs-test: cuda -->``
      needs a GPU: skipped without CUDA, run in the file's namespace with it.
  ``<!-- docs-test: distributed -->``
      needs several processes: the file's distributed blocks (with their setups) run in order,
      in one namespace per process, under ``torchrun --standalone --nproc-per-node 2`` on the
      CPU (gloo). They do not see the file's other blocks. One launch runs every file's, file
      after file, each in its own namespace, directory and process group (its own rendezvous).
  ``<!-- docs-test: skip REASON -->``
      cannot run here at all (code of another library shown for comparison, e.g. NVIDIA Apex,
      which no index serves); the reason is required and shown in the skip.

A directive that is misspelt or stands before no python block fails the test, so a block never
silently stops being run.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.docs_blocks import ROOT, Block, doc_files, parse, run_block

FILES = doc_files()
_IDS = [p.relative_to(ROOT).as_posix() for p in FILES]


def _reset_process_state() -> None:
    """What a page's blocks may leave behind in this process, put back for the next test.

    Only for modules a block imported: importing one here would cost seconds per page.
    """
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState, PartialState

        # Accelerate keeps one state per process (see docs/integrations.md)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()


@pytest.mark.parametrize("path", FILES, ids=_IDS)
def test_blocks_run_in_order(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = parse(path)
    monkeypatch.chdir(tmp_path)
    # The blocks run in a module that is importable, as a reader's script is (``__main__``):
    # torch 2.11's dynamo imports the module of a compiled function's globals by name.
    module = types.ModuleType("__docs__")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace: dict = module.__dict__
    skipped: list[str] = []
    try:
        for block in blocks:
            if block.mode in ("distributed", "skip") or (
                block.mode == "cuda" and not torch.cuda.is_available()
            ):
                skipped.append(f"{block.where}: {block.mode} {block.reason}".rstrip())
                continue
            try:
                run_block(block, namespace)
            except BaseException as exc:
                raise AssertionError(f"{block.where} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        namespace.clear()
        _reset_process_state()
    if not any(b.mode in ("cpu", "cuda") for b in blocks) and skipped:
        pytest.skip("; ".join(skipped))


def _distributed_files() -> list[Path]:
    return [p for p in FILES if any(b.mode == "distributed" for b in parse(p))]


@pytest.fixture(scope="module")
def torchrun_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Every page's distributed blocks, run in one torchrun launch: file -> each rank's outcome.

    torchrun's own entry point, called in this process (torch is imported already, which saves
    an interpreter); it starts two workers that run the pages one after another (each page in
    its own namespace and directory, its process group destroyed after it). One launch for all
    pages: a launch's start cost 12 s a page on 2 cores, the blocks under 1 s. On the CPU
    (gloo) even where a GPU is present: two processes, one device at most.
    """
    from torch.distributed import run as torchrun

    work, report = tmp_path_factory.mktemp("torchrun"), tmp_path_factory.mktemp("report")
    script = ROOT / "tests" / "docs_blocks.py"
    files = [str(p) for p in _distributed_files()]
    args = ["--standalone", "--nproc-per-node", "2", str(script), "--report", str(report), *files]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.chdir(work)
        # A worker that fails raises here; its report says where, and each page's test why.
        launch_error = ""
        try:
            torchrun.run(torchrun.parse_args(args))
        except Exception as exc:
            launch_error = f"{type(exc).__name__}: {exc}"
    outcomes: dict[str, list[str]] = {f: [] for f in files}
    for rank_file in sorted(report.glob("rank*.json")):
        for f, outcome in json.loads(rank_file.read_text()).items():
            outcomes[f].append(f"{rank_file.stem}: {outcome}")
    outcomes[""] = [launch_error]  # the launch's own error, for a page no rank reported on
    return outcomes


@pytest.mark.distributed
@pytest.mark.parametrize("path", _distributed_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_distributed_blocks_under_torchrun(path: Path, torchrun_outcomes: dict) -> None:
    outcomes = torchrun_outcomes[str(path)]
    failed = [o for o in outcomes if not o.endswith(": ok")]
    assert not failed, "\n".join(failed)
    if len(outcomes) < 2:  # an earlier page failed first, or a worker died without a report
        earlier = [Path(f).relative_to(ROOT).as_posix() for f, o in torchrun_outcomes.items()
                   if f and any(not x.endswith(": ok") for x in o)]  # fmt: skip
        pytest.fail(
            f"ran on {len(outcomes)} of 2 ranks: the launch stopped at the first failing "
            f"page ({', '.join(earlier) or 'none reported'}: its own test says why); "
            f"torchrun: {torchrun_outcomes[''][0] or 'no error'}"
        )


def test_every_page_is_read() -> None:
    """The parser sees every python fence: count them independently, by the fence lines."""
    for path in FILES:
        text = path.read_text(encoding="utf-8").splitlines()
        fences = sum(1 for line in text if line.strip() == "```python")
        blocks: list[Block] = parse(path)
        assert len(blocks) == fences, path


def _resolve(dotted: str) -> object:
    """The object a mkdocstrings identifier names: its longest importable module, then getattr."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_api_reference_lists_every_public_name() -> None:
    """docs/api.md documents mixprec.__all__ and every public class of mixprec.integrations."""
    import mixprec

    text = (ROOT / "docs" / "api.md").read_text()
    # objects, not names: `mixprec.autocast` is documented as the class it is, since the name
    # `mixprec.eager.autocast` is also its module's (mkdocstrings would show the module)
    listed = {id(_resolve(name)) for name in re.findall(r"^::: ([\w.]+)$", text, re.M)}
    wanted = {f"mixprec.{n}": getattr(mixprec, n) for n in mixprec.__all__ if n != "__version__"}
    for name in ("engine", "errors", "lightning", "accelerate", "transformers", "tensorboard"):
        module = importlib.import_module(f"mixprec.integrations.{name}")
        for n in module.__all__:
            obj = getattr(module, n)
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                wanted[f"{module.__name__}.{n}"] = obj
    missing = sorted(name for name, obj in wanted.items() if id(obj) not in listed)
    assert not missing, f"add to docs/api.md: {', '.join('::: ' + n for n in missing)}"
    for heading in re.findall(r"^      heading: ([\w.]+)$", text, re.M):
        assert heading in wanted, heading  # a custom heading names the public path
