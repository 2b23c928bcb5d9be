"""fp16 that needs no babysitting: find the modules that overflow and run them in fp32.

- `mixprec.tune_policy` (offline, `mixprec.heal.tune`): a few steps against an fp32 shadow give
  the smallest set of modules to keep in fp32, with a report per move.
- healing (online, `mixprec.heal.online`): ``initialize(..., heal=True)`` moves a module that
  keeps overflowing to fp32 for the rest of the run instead of letting the loss scale collapse;
  the moves are logged, explained and saved with checkpoints.
- `mixprec.heal.underflow`: modules whose gradients flush to zero at the current scale, and
  what to do about each.

This package's ``__init__`` imports only the settings (the opt levels read them); the parts
that use the levels are imported from their modules.
"""

from mixprec.heal.config import HealConfig

__all__ = ["HealConfig"]
