"""Image-classification data for ``mixprec train``, all local: nothing is downloaded.

- ``digits`` (default): the 1,797 8x8 handwritten digits that ship inside scikit-learn
  (``sklearn.datasets.load_digits``); 1,437 for training, 360 for testing (a fixed split).
- ``cifar10:PATH``: CIFAR-10 from a local folder in its standard python-pickle format
  (``data_batch_1`` ... ``data_batch_5`` and ``test_batch``).
- ``synthetic``: 10 classes of 3x32x32 images drawn around class-specific patterns; no files.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
from dataclasses import dataclass

import torch

from mixprec.errors import MixprecError

__all__ = ["DATASETS", "DataError", "Dataset", "digits_arrays", "load", "token_stream"]

#: The forms ``--data`` accepts.
DATASETS = ("digits", "synthetic", "cifar10:PATH")


class DataError(MixprecError, ValueError):
    """A data set that cannot be loaded (the message says what is missing)."""


@dataclass
class Dataset:
    """Normalized images (N, C, H, W) and integer labels, split into train and test."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int

    @property
    def in_channels(self) -> int:
        return self.train_x.shape[1]

    def describe(self) -> str:
        c, h, w = self.train_x.shape[1:]
        return (f"{self.name}: {len(self.train_x)} train / {len(self.test_x)} test images, "
                f"{c}x{h}x{w}, {self.num_classes} classes")  # fmt: skip


def _normalize(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = train.mean(dim=(0, 2, 3), keepdim=True)
    std = train.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return (train - mean) / std, (test - mean) / std


def _bundled_digits_file() -> str | None:
    """The CSV file scikit-learn ships the digits in, found without importing scikit-learn."""
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return path
    return None


def digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1,797 digits as (fp32 pixels in [0, 16], shape (1797, 64); int64 labels), the values
    ``sklearn.datasets.load_digits()`` returns, in its order.

    Read straight from the CSV file scikit-learn bundles (20 ms), not through
    ``load_digits``: importing scikit-learn costs about 3 s of CPU, paid again by every process
    (each rank of a data-parallel ``mixprec train``). Falls back to ``load_digits`` if the file
    is not where scikit-learn 1.x keeps it.

    Raises:
        DataError: scikit-learn is not installed (the message says how to install it).
    """
    path = _bundled_digits_file()
    if path is not None:
        with gzip.open(path, "rt") as fh:
            rows = [[float(v) for v in line.split(",")] for line in fh if line.strip()]
        table = torch.tensor(rows, dtype=torch.float32)
        return table[:, :-1].contiguous(), table[:, -1].long()
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        from mixprec._optional import install_hint

        raise DataError(
            "the default data set (digits) ships with scikit-learn: "
            f"{install_hint(['data'], ['scikit-learn'])}, or use --data synthetic."
        ) from err
    digits = load_digits()
    return (torch.tensor(digits.data, dtype=torch.float32),
            torch.tensor(digits.target, dtype=torch.long))  # fmt: skip


def _digits() -> Dataset:
    pixels, y = digits_arrays()
    x = pixels.view(-1, 1, 8, 8) / 16.0
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = 1437
    train_x, test_x = _normalize(x[:cut], x[cut:])
    return Dataset("digits", train_x, y[:cut], test_x, y[cut:], 10)


def _synthetic() -> Dataset:
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(10, 3, 32, 32, generator=g)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 10, (n,), generator=g)
        return patterns[y] + 1.5 * torch.randn(n, 3, 32, 32, generator=g), y

    (tx, ty), (vx, vy) = draw(2048), draw(512)
    tx, vx = _normalize(tx, vx)
    return Dataset("synthetic", tx, ty, vx, vy, 10)


def _cifar10(path: str) -> Dataset:
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    if not os.path.isdir(path):
        raise DataError(f"--data cifar10:{path}: {path!r} is not a folder.")
    present = [f for f in files if os.path.exists(os.path.join(path, f))]
    if "test_batch" not in present or not any(f.startswith("data_batch") for f in present):
        raise DataError(
            f"--data cifar10:{path}: expected CIFAR-10's python files (data_batch_1 ... "
            f"data_batch_5, test_batch) in {path!r}; found {present or 'none'}."
        )

    def read(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        with open(os.path.join(path, name), "rb") as fh:
            batch = pickle.load(fh, encoding="bytes")
        try:
            data, labels = batch[b"data"], batch[b"labels"]
        except (KeyError, TypeError) as err:
            raise DataError(f"{name} is not a CIFAR-10 batch (no b'data'/b'labels').") from err
        # (the batches hold numpy arrays: unpickling them needs numpy, which scikit-learn has)
        x = torch.as_tensor(data, dtype=torch.uint8)
        return x.view(-1, 3, 32, 32).float() / 255.0, torch.as_tensor(labels, dtype=torch.long)

    parts = [read(f) for f in present if f.startswith("data_batch")]
    train_x = torch.cat([p[0] for p in parts])
    train_y = torch.cat([p[1] for p in parts])
    test_x, test_y = read("test_batch")
    train_x, test_x = _normalize(train_x, test_x)
    return Dataset("cifar10", train_x, train_y, test_x, test_y, 10)


def load(spec: str) -> Dataset:
    """Load ``digits``, ``synthetic`` or ``cifar10:PATH``."""
    if spec == "digits":
        return _digits()
    if spec == "synthetic":
        return _synthetic()
    if spec.startswith("cifar10:"):
        return _cifar10(spec.split(":", 1)[1])
    raise DataError(
        f"unknown data set {spec!r}. Valid: 'digits' (scikit-learn's bundled digits, the "
        f"default), 'synthetic', or 'cifar10:PATH' (a folder with CIFAR-10's python batches)."
    )


def token_stream(
    vocab: int, batch: int, seq: int, steps: int, seed: int = 0, branching: int = 4
) -> list[torch.Tensor]:
    """`steps` batches of (batch, seq) tokens from a fixed random Markov chain, for language
    models: each token is followed by one of `branching` successors (chosen once, with random
    probabilities), so next-token loss can fall from ln(vocab) towards the chain's entropy.

    The chain depends only on `vocab` and `branching` (it is drawn from seed 0); the batches on
    `seed`, so runs with different seeds see different samples of the same language.
    """
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, vocab, (vocab, branching), generator=g)
    probs = torch.softmax(torch.randn(vocab, branching, generator=g) * 2, dim=1)
    g.manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, seq):
            prev = tokens[:, t - 1]
            pick = torch.multinomial(probs[prev], 1, generator=g).squeeze(1)
            tokens[:, t] = successors[prev, pick]
        out.append(tokens)
    return out
