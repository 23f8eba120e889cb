import os

import pytest
import torch

# Tests run on CPU with 2 cores; keep torch from oversubscribing them.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
