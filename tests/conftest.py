import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


# One intra-op thread: the suite's models are tiny, and on two shared cores OpenMP's second thread
# makes them several times slower rather than faster.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield

