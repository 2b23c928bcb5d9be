"""Lightning's tests need Lightning (the ``lightning`` extra): skip the folder without it."""

import importlib.util

if importlib.util.find_spec("lightning") is None:
    collect_ignore_glob = ["test_*.py"]
