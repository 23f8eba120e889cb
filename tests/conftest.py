import os

import pytest
import torch

# Tests run on CPU with 2 cores; keep torch from oversubscribing them: one thread per xdist worker (`make test`
# runs one worker per core), up to 2 in a single process.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _threads():
    """A test that sets torch's thread count (a program run in-process, a one-thread measurement) leaves it as it
    found it: the tests after it run, and sum, as they do alone."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _torch_home(tmp_path_factory):
    """Weights resolved or converted during the tests (the FID Inception) go to a session folder, never to the
    user's torch cache."""
    old = os.environ.get("TORCH_HOME")
    os.environ["TORCH_HOME"] = str(tmp_path_factory.mktemp("torch_home"))
    yield
    if old is None:
        os.environ.pop("TORCH_HOME", None)
    else:
        os.environ["TORCH_HOME"] = old
