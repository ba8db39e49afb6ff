"""``tunefree audit``: audit a configuration through the real training step and print a verdict.

Exit status: 0 when the audit is consistent with the claimed ε, 1 when ε_LB > ε or a check failed,
2 on bad input (as every command).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .. import CLIP_FUNCTIONS, GROUPINGS
from ..privacy import ACCOUNTANTS


def add_parser(commands: Any, positive_float: Any, positive_int: Any, delta: Any,
               learning_rate: Any) -> argparse.ArgumentParser:
    """The ``audit`` subcommand, with the flag names of ``train`` and ``epsilon``."""
    audit = commands.add_parser(
        "audit", help="empirical privacy audit: a lower bound on ε that a correct run never exceeds",
        description="Audit a configuration in one real training run with gradient canaries (Steinke, "
                    "Nasr & Jagielski 2023), or in many runs with one canary (Clopper–Pearson, "
                    "--runs): prints the ledger's ε, ε_LB at the stated confidence and a verdict.")
    target = audit.add_mutually_exclusive_group(required=True)
    target.add_argument("--noise-multiplier", type=positive_float, help="σ of the audited run")
    target.add_argument("--target-epsilon", type=positive_float,
                        help="ε the noise is calibrated for")
    audit.add_argument("--sample-rate", type=positive_float, default=0.5,
                       help="Poisson sampling rate q, a fraction a/b with b ≤ 10000 (default: 0.5)")
    audit.add_argument("--steps", type=positive_int, default=20, help="steps of the run (default: 20)")
    audit.add_argument("--delta", type=delta, default=1e-5, help="δ (default: 1e-5)")
    audit.add_argument("--canaries", type=positive_int, default=1000,
                       help="gradient canaries, each included with probability ½ (default: 1000)")
    audit.add_argument("--runs", type=positive_int, default=None,
                       help="instead of one run with many canaries: this many runs with one canary "
                            "each (Clopper–Pearson)")
    audit.add_argument("--clipping", choices=CLIP_FUNCTIONS, default="auto-s")
    audit.add_argument("--groups", choices=GROUPINGS, default="all-layer")
    audit.add_argument("--thresholds", choices=("fixed", "adaptive"), default="fixed")
    audit.add_argument("--lr", type=learning_rate, default=0.1,
                       help="learning rate of the run's SGD, 'auto' or 'hyfreedp' (default: 0.1)")
    audit.add_argument("--accountant", choices=ACCOUNTANTS, default="pld")
    audit.add_argument("--confidence", type=float, default=0.95,
                       help="confidence of ε_LB and of each check (default: 0.95)")
    audit.add_argument("--real-examples", type=positive_int, default=256,
                       help="at least this many real examples beside the canaries (default: 256)")
    audit.add_argument("--seed", type=int, default=None,
                       help="a reproducible audit (default: secure randomness)")
    audit.add_argument("--json", type=Path, help="write the result as JSON to this file")
    return audit


def run(args: argparse.Namespace) -> int:
    from .. import audit as auditing

    settings = auditing.AuditSettings(
        canaries=args.canaries, steps=args.steps, sample_rate=args.sample_rate,
        noise_multiplier=args.noise_multiplier, target_epsilon=args.target_epsilon, delta=args.delta,
        clipping=args.clipping, groups=args.groups, thresholds=args.thresholds, lr=args.lr,
        accountant=args.accountant, real_examples=args.real_examples, confidence=args.confidence,
        seed=args.seed)
    result = (auditing.one_run_audit(settings) if args.runs is None
              else auditing.multi_run_audit(settings, args.runs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    print(result.explain())
    return 0 if result.verdict == "consistent" else 1
