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


# Slow tests in files that other branches of issue 32 are rewriting now: marked here so that those files
# need no edit; the marks move into the files once the branches are merged.
SLOW_ELSEWHERE = {
    "tests/components/test_autolr.py::test_adaptive_thresholds_and_auto_lr_share_one_budget",
    "tests/components/test_autolr.py::test_laplace_is_dominated_by_its_gaussian",
    "tests/components/test_autolr.py::test_laplace_loss_privacy_runs_and_is_accounted",
    "tests/components/test_autolr.py::test_planned_run_meets_the_target_and_every_update_step_is_one_event",
    "tests/persample/test_engine_user_code.py::test_compiled_model_is_refused_at_construction",
    "tests/test_architecture.py::test_import_tunefree_leaves_the_heavy_optional_modules_unimported",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.split("[")[0] in SLOW_ELSEWHERE:
            item.add_marker(pytest.mark.slow)
