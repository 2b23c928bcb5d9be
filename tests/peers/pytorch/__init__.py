"""PyTorch's own autocast unit tests, with the region under test opened by ``mixprec.autocast``.

Adapted from PyTorch's test/test_autocast.py as of the torch 2.13 release (see the header of
test_autocast_peer.py); tests left out or changed in meaning are listed with the reason in
docs/migration.md, "Running PyTorch's autocast tests".
"""
