"""The whole training step as one call: `TrainStep`, CUDA-graph captured where it can be."""

from mixprec.step.trainstep import CAPTURE_MODES, TrainStep, TrainStepError

__all__ = ["CAPTURE_MODES", "TrainStep", "TrainStepError"]
