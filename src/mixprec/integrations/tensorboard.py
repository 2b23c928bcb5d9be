"""`TensorBoardSink`: write `mixprec.AmpMetrics` batches as TensorBoard scalars.

    metrics = mixprec.AmpMetrics(scaler, every=100, sinks=[TensorBoardSink("runs/exp1")])

Each row of a batch becomes ``add_scalar(name, value, step)`` at its own step, so the curve has
every step even though the values left the device once per batch; each diagnosed skipped step
becomes ``add_text`` under the batch's text tag. The writer is torch's
``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` extra: ``pip install -e
'.[tensorboard]'`` in the checkout); it is flushed after every batch.
"""

from __future__ import annotations

from typing import Any

from mixprec.diagnostics.metrics import MetricsBatch
from mixprec.integrations import require

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Write metric batches to a TensorBoard log directory (or an existing ``SummaryWriter``).

    Args:
        log_dir: the directory for the event file, or a ``SummaryWriter`` to use as it is.
        prefix: prepended to every tag (e.g. ``'amp/'``); empty keeps the conventions' names.
    """

    def __init__(self, log_dir: Any, prefix: str = "") -> None:
        if isinstance(log_dir, str) or hasattr(log_dir, "__fspath__"):
            require("tensorboard", "tensorboard", "mixprec.integrations.tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir))
            self._owned = True
        elif hasattr(log_dir, "add_scalar"):
            self.writer = log_dir
            self._owned = False
        else:
            raise TypeError(
                f"TensorBoardSink needs a log directory or a SummaryWriter, got "
                f"{type(log_dir).__name__}."
            )
        self.prefix = prefix

    def __call__(self, batch: MetricsBatch) -> None:
        for step, row in batch.rows:
            for name, value in row.items():
                self.writer.add_scalar(self.prefix + name, value, step)
        for step, text in batch.events:
            self.writer.add_text(self.prefix + batch.text_tag, text, step)
        for step, text in batch.moves:  # healing's moves to fp32, with their reasons
            self.writer.add_text(self.prefix + batch.moves_tag, text, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush, and close the writer if this sink opened it."""
        self.writer.flush()
        if self._owned:
            self.writer.close()
