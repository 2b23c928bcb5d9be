"""mixprec at scale: DistributedDataParallel, FSDP2, sharded checkpoints and launching.

PyTorch's engines do the distributed work; this package fits the opt levels, the scaler and
TrainStep to them (docs/distributed.md):

- `fully_shard`: an opt level through FSDP2's own MixedPrecisionPolicy (fp32 shards are the
  masters; low-precision all-gathers, fp32 reduce-scatters, norm layers as fp32 units).
- `fp8`: FP8 layers' weights all-gathered in FP8 with their scale (``fully_shard(..., fp8=)``).
- `wrapping`: what ``initialize`` accepts from DDP and FSDP2, in which order, and why.
- `agreement`: when the scaler can skip its found-inf all-reduce (DDP reduced every gradient).
- `ddp`: PyTorch's rules for capturing a DDP step in a CUDA graph (TrainStep follows them).
- `checkpoint`: model, optimizer (masters included) and scaler through torch.distributed.checkpoint.
- `launch`: torchrun underneath ``mixprec train/bench --nproc-per-node``.

Importing this package imports neither FSDP2 nor DTensor nor DCP; they load when used.
"""

from mixprec.distributed.checkpoint import load_checkpoint, save_checkpoint
from mixprec.distributed.fsdp import fully_shard
from mixprec.distributed.topology import DistributedError

__all__ = ["DistributedError", "fully_shard", "load_checkpoint", "save_checkpoint"]
