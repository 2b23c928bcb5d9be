"""Where the suite's parts run: their environment, the device probe, the commit, carried wheels.

- `part_env`: every part gets ``PYTHONPATH=<root>/src:<carried wheels>:<root>:$PYTHONPATH`` (the
  package runs from the working tree, not installed), unbuffered output, a headless matplotlib,
  and in smoke runs no visible GPU (``CUDA_VISIBLE_DEVICES=''``: toy sizes on the CPU even on a
  GPU machine) and one CPU thread per part unless ``OMP_NUM_THREADS`` says otherwise.
- `probe`: one subprocess in that environment reports the device, torch/CUDA/Python versions
  and which of the parts' required modules import (and, if not, which module is missing), so
  the parent never touches CUDA itself; forked from the parts' preloading server when there
  is one (`suite.launch.Preloaded`), which spares it importing torch and mixprec again.
- `git_commit`: ``git rev-parse HEAD`` (+ ``-dirty``), else ``.git`` read by hand, else
  "unknown" (the device gets a copy of the working tree, often without ``.git``).
- `install_wheels`: the device has no package index; wheels carried in a folder are installed
  once per call with ``pip --no-index --target`` (pure-Python wheels fall back to zipimport).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

_PROBE = r"""
import importlib, json, platform, sys
out = {"python": platform.python_version(), "modules": {}}
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda,
               cuda_available=torch.cuda.is_available())
    if out["cuda_available"]:
        out["device_name"] = torch.cuda.get_device_name(0)
        out["cudnn"] = torch.backends.cudnn.version()
    else:
        name = platform.processor() or "cpu"
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        out["device_name"] = name
except Exception as err:
    out["torch_error"] = f"{type(err).__name__}: {err}"
try:
    import mixprec
    out["mixprec"] = mixprec.__version__
except Exception as err:
    out["mixprec_error"] = f"{type(err).__name__}: {err}"
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        out["modules"][name] = {"ok": True}
    except ModuleNotFoundError as err:
        out["modules"][name] = {"ok": False, "missing": err.name, "error": str(err)}
    except Exception as err:
        out["modules"][name] = {"ok": False, "missing": None,
                                "error": f"{type(err).__name__}: {err}"}
print("PROBE " + json.dumps(out))
"""


def part_env(root: str, extra_paths: Sequence[str], smoke: bool) -> dict[str, str]:
    """The environment of every part (see the module docstring)."""
    env = dict(os.environ)
    paths = [os.path.join(root, "src"), *extra_paths, root]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env["MPLBACKEND"] = "Agg"
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # Toy sizes measure nothing; one thread keeps them quick on a small or shared CPU,
        # where two oneDNN threads per process spin against other work (3-4x slower seen).
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def probe(env: dict[str, str], modules: Sequence[str], cwd: str, launcher: Any = None,
          work_dir: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Device, versions and module availability, as the parts will see them.

    With `launcher` (a `Preloaded` whose canary passed) the probe is a script in `work_dir`,
    forked like a part, its output in ``probe.log`` there; else a fresh interpreter.
    """
    timeout = 300
    if launcher is None:
        try:
            out = subprocess.run([sys.executable, "-c", _PROBE, *modules], env=env, cwd=cwd,
                                 capture_output=True, text=True, timeout=timeout)  # fmt: skip
            text = out.stdout + ("\n" + out.stderr if out.stderr else "")
        except subprocess.TimeoutExpired:
            text = None
    else:
        assert work_dir is not None, "a forked probe writes its script and log in work_dir"
        os.makedirs(work_dir, exist_ok=True)
        script, log = os.path.join(work_dir, "probe.py"), os.path.join(work_dir, "probe.log")
        with open(script, "w") as fh:
            fh.write(_PROBE)
        _, timed_out = launcher.run([sys.executable, script, *modules], cwd=cwd, log_path=log,
                                    timeout=timeout)  # fmt: skip
        try:
            with open(log, errors="replace") as fh:
                text = None if timed_out else fh.read()
        except OSError as err:  # the child ended before it opened its log
            text = f"the forked probe wrote no log: {err}"
    if text is None:
        return {"probe_error": f"the probe did not answer within {timeout} s", "modules": {}}
    for line in reversed(text.splitlines()):
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE ") :])
    return {"probe_error": text[-2000:], "modules": {}}


def _git(root: str, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                             timeout=20)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _read_head(root: str) -> str | None:
    """HEAD's commit from the files of a plain ``.git`` folder (no git program needed)."""
    git = os.path.join(root, ".git")
    try:
        with open(os.path.join(git, "HEAD")) as fh:
            head = fh.read().strip()
        if not head.startswith("ref: "):
            return head or None
        ref = head[5:]
        ref_file = os.path.join(git, ref)
        if os.path.isfile(ref_file):
            with open(ref_file) as fh:
                return fh.read().strip() or None
        with open(os.path.join(git, "packed-refs")) as fh:
            for line in fh:
                sha, _, name = line.strip().partition(" ")
                if name == ref:
                    return sha
    except OSError:
        return None
    return None


def git_commit(root: str, override: str | None = None) -> str:
    """The commit the working tree is at (``-dirty`` if tracked files changed), or "unknown"."""
    if override:
        return override
    sha = _git(root, "rev-parse", "HEAD")
    if sha:
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
        return sha + ("-dirty" if dirty else "")
    return _read_head(root) or "unknown"


def install_wheels(folder: str | None, target: str) -> tuple[list[str], list[str], str]:
    """Install the ``*.whl`` in `folder` into `target`: (wheel names, paths to add, note)."""
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl"))) if folder else []
    if not wheels:
        return [], [], ""
    names = [os.path.basename(w) for w in wheels]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", target, *wheels]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode == 0:
            return names, [target], f"installed into {target}"
        why = (out.stderr or out.stdout).strip()[-300:]
    except (OSError, subprocess.SubprocessError) as err:
        why = str(err)
    # A pure-Python wheel is a zip that Python imports from directly.
    return names, wheels, f"pip failed ({why}); wheels put on PYTHONPATH as zip files"
