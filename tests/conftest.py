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




# Slow tests in files that other branches of issue 32 are rewriting now (HyFreeDP in one place, the engine
# split, the architecture test), marked here so that those files need no edit: by file and function, with
# the part of a case's id that marks only those cases ("": every case). The marks move into the files once
# those branches are merged.
SLOW_ELSEWHERE = {
    "tests/components/test_autolr.py": {
        "test_adaptive_thresholds_and_auto_lr_share_one_budget": "",
        "test_laplace_is_dominated_by_its_gaussian": "",
        "test_laplace_loss_privacy_runs_and_is_accounted": "",
        "test_planned_run_meets_the_target_and_every_update_step_is_one_event": "",
    },
    "tests/persample/test_engine_user_code.py": {"test_compiled_model_is_refused_at_construction": ""},
    "tests/privacy/test_plan.py": {
        "test_checkpoint_of_an_auto_lr_run_is_refused_by_a_fixed_lr_run": "",
        "test_combined_plan_does_not_depend_on_the_order_its_components_are_declared_in": "",
        "test_component_states_are_restored_strictly": "",
        "test_every_component_records_exactly_the_releases_its_share_planned": "HyFreeDP",
        "test_make_private_records_prior_releases_first_and_spends_the_target_in_all": "",
        "test_prior_releases_are_in_the_calibration_so_the_whole_run_spends_the_target": "",
        "test_recorded_ledger_spends_what_the_plan_said": "adaptive+auto",
        "test_solved_plan_spends_the_target_within_one_percent_never_above": "",
    },
    "tests/test_architecture.py": {"test_import_tunefree_leaves_the_heavy_optional_modules_unimported": ""},
}


def pytest_collection_modifyitems(items):
    for item in items:
        path, _, test = item.nodeid.partition("::")
        function, _, case = test.partition("[")
        marked = SLOW_ELSEWHERE.get(path, {})
        if function in marked and marked[function] in case:
            item.add_marker(pytest.mark.slow)
