"""Empirical privacy auditing: statistical lower bounds ε_LB that a correct run never exceeds
(with the stated confidence). docs/audit.md says what each audit proves and what it does not."""

from .black_box import black_box_audit
from .bounds import Guesses, clopper_pearson_epsilon_bound, one_run_epsilon_bound, one_run_p_value
from .checks import Check, noise_check, separation_check
from .fdp import PrivacyCurve, curve_of, fdp_epsilon_bound, fdp_rejects
from .multi_run import multi_run_audit
from .one_run import one_run_audit
from .result import AuditResult
from .training import audit_training
from .whitebox import AuditSettings

__all__ = [
    "AuditResult", "AuditSettings", "Check", "Guesses", "PrivacyCurve", "audit_training", "black_box_audit",
    "clopper_pearson_epsilon_bound", "curve_of", "fdp_epsilon_bound", "fdp_rejects", "multi_run_audit",
    "noise_check", "one_run_audit", "one_run_epsilon_bound", "one_run_p_value", "separation_check",
]
