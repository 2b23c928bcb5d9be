"""Lightning's own tests of its AMP plugins, with mixprec's plugins in place of Lightning's.

Adapted from Lightning-AI/pytorch-lightning at tag 2.6.5 (the installed 2.6.6 ships the same
plugin sources): tests_fabric/plugins/precision/test_amp*.py, tests_pytorch/plugins/precision/
test_amp*.py, tests_pytorch/plugins/test_amp_plugins.py and tests_pytorch/models/test_amp.py.
Each file keeps Lightning's license header and says what changed. Where a test builds
Lightning's ``MixedPrecision`` (or passes ``precision="16-mixed"``), it builds mixprec's plugin
at the same setting (`amp.SETTINGS`): what a migrating user writes. Tests left out, and tests
changed in meaning, are listed with the reason in docs/migration.md, "Running Lightning's AMP
tests".
"""
