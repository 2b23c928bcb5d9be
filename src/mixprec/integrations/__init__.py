"""mixprec where people train: Lightning, Accelerate, the Transformers Trainer, TensorBoard.

Each submodule imports its framework when it is imported and, when the framework is missing,
fails with a message that names the extra to install (``pip install -e '.[EXTRA]'`` in the
checkout):

- `mixprec.integrations.lightning` (extra ``lightning``): ``MixprecPrecision`` for
  ``lightning.Trainer(plugins=[...])``, ``MixprecFabricPrecision`` for ``Fabric(plugins=[...])``,
  ``MixprecFSDPPrecision`` for Lightning's ``FSDPStrategy``, ``AmpMetricsCallback``;
- `mixprec.integrations.accelerate` (extra ``hf``): ``AmpAccelerator``, an
  ``accelerate.Accelerator`` with mixprec's autocast, scaler and opt levels;
- `mixprec.integrations.transformers` (extra ``hf``): ``AmpTrainerMixin`` / ``AmpTrainer``
  for ``transformers.Trainer``, and the ``AmpMetricsCallback`` it installs;
- `mixprec.integrations.tensorboard` (extra ``tensorboard``): ``TensorBoardSink``, which
  writes `mixprec.AmpMetrics` batches as TensorBoard scalars.

All of them share `mixprec.integrations.engine` (``AmpConfig``, the settings; ``AmpEngine``, the
precision half of a step that a framework drives). None of them patches the framework: they use
its documented extension points (precision plugins, callbacks, subclass hooks) and composition.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise ImportError naming the mixprec extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        from mixprec._optional import install_hint

        package = module.split(".")[0]
        raise ImportError(
            f"{feature} needs the '{package}' package, which is not installed ({err}). Install "
            f"the '{extra}' extra: {install_hint([extra], [package])}."
        ) from err
