"""``tunefree train``, ``tunefree predict``, ``tunefree epsilon`` and ``tunefree audit``: private training,
predictions of a trained table model on new rows (cli/predict.py), the privacy calculator and the
empirical audit (cli/audit.py).

Errors a person can act on are one line on stderr and exit status 2; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .. import CLIP_FUNCTIONS, GROUPINGS
from ..privacy import ACCOUNTANTS, NOISE_ALLOCATIONS
from . import audit, predict, text
from .models import MODELS

EXIT_USAGE = 2


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _learning_rate(text: str) -> float | str:
    """A positive number, ``auto`` (SGD's automatic step size) or ``hyfreedp`` (HyFreeDP's)."""
    if text in ("auto", "hyfreedp"):
        return text
    return _positive_float(text)


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if not value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def _names(text: str) -> tuple[str, ...]:
    """Comma-separated values, e.g. ``neg,pos`` or ``?,NA``."""
    names = tuple(part.strip() for part in text.split(","))
    if not text.strip() or any(not name for name in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated values like a,b, got {text!r}")
    return names


def _widths(text: str) -> tuple[int, ...]:
    """Comma-separated layer widths, e.g. ``256,256``."""
    try:
        widths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected widths like 256,256, got {text!r}") from None
    if any(width < 1 for width in widths):
        raise argparse.ArgumentTypeError(f"every width must be at least 1, got {text}")
    return widths


def _delta(text: str) -> float:
    value = _positive_float(text)
    if not value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, pointing to --help, instead of the whole usage text."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    from .training import DEFAULT_BATCH_SIZE, NUMERIC_SCALINGS, OPTIMIZERS, TrainConfig

    defaults = TrainConfig()
    root = _Parser(
        prog="tunefree", description="Differentially private training with no DP hyperparameters.")
    root.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = root.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = commands.add_parser(
        "train", help="train a model privately",
        description="Train a model with an (ε, δ)-DP guarantee on built-in or local data.")
    train.add_argument("--dataset", "--data", default="digits",
                       help="'digits' (built in) or a local path: an MNIST/Fashion-MNIST IDX "
                            "directory, cifar-10-batches-py, a .csv/.jsonl/.parquet table, or a Hugging Face "
                            "save_to_disk directory (default: digits)")
    train.add_argument("--label-column", default=None,
                       help="label column of a table or HF data set (default: label)")
    train.add_argument("--schema", type=Path, default=None,
                       help="a table's public schema (JSON): category sets and value ranges of its "
                            "columns, so that nothing about them is read from the private rows (default: "
                            "category sets selected privately, 2%% of the budget's μ² a column, in the "
                            "ledger)")
    train.add_argument("--labels", type=_names, default=None,
                       help="the classes, comma-separated (e.g. neg,pos), declared public (default: "
                            "selected privately from the training rows' labels, 7%% of the budget's μ², "
                            "in the ledger; labels not selected become the class '(other)'; the built-in "
                            "digits and CIFAR-10 have their own)")
    train.add_argument("--numeric-scaling", choices=NUMERIC_SCALINGS, default=defaults.numeric_scaling,
                       help="numeric table columns with no range in --schema: private (standardised by "
                            "an estimate that spends 4%% of the budget's μ², more for a small table, in the "
                            "ledger) or none (fed as they are) (default: private)")
    train.add_argument("--na-values", type=_names, default=(),
                       help="comma-separated cell texts that mark a missing value, e.g. '?,NA,N/A' "
                            "(default: pandas' own: empty, NA, N/A, NaN, null, …)")
    train.add_argument("--drop-rows-with-missing", action="store_true",
                       help="drop every row with a missing value instead of refusing it (each row's fate "
                            "depends on that row alone)")
    train.add_argument("--test-data", default=None,
                       help="a table of the same columns to test on; every row of --dataset then trains "
                            "(default: the rows whose keyed hash falls in the lowest 20%%)")
    train.add_argument("--model", default=defaults.model,
                       help=f"{', '.join(MODELS)} (auto: a CNN for images of 24 pixels or more a side, an "
                            "MLP otherwise), or PATH of a local Hugging Face model to fine-tune on text "
                            "(see the text model flags below)")
    train.add_argument("--hidden", type=_widths, default=None,
                       help="hidden layer widths of the MLP, e.g. 256,256 (default: 128)")
    train.add_argument("--epsilon", type=_positive_float, default=defaults.epsilon,
                       help=f"privacy budget ε; 'inf' trains the same run without noise, a non-private "
                            f"reference to compare with (default: {defaults.epsilon})")
    train.add_argument("--delta", type=_delta, default=None,
                       help="δ of the guarantee (default: 1/N^1.1 for N training examples; the output "
                            "says which δ and why)")
    length = train.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=_positive_float, default=None,
                        help="planned passes over the data, fractional allowed: the run takes "
                             f"⌈epochs·round(1/q)⌉ steps (default: {defaults.epochs})")
    length.add_argument("--steps", type=_positive_int, default=None,
                        help="planned number of steps, instead of --epochs")
    train.add_argument("--batch-size", type=_positive_int, default=None,
                       help="expected batch size; the sampling rate is batch_size/N "
                            f"(default: {DEFAULT_BATCH_SIZE}, or N where the training rows are fewer; for "
                            "text models see --train-weights)")
    train.add_argument("--clipping", choices=CLIP_FUNCTIONS, default=defaults.clipping,
                       help=f"per-sample clipping (default: {defaults.clipping})")
    train.add_argument("--groups", choices=GROUPINGS, default=defaults.groups,
                       help=f"clip groups (default: {defaults.groups})")
    train.add_argument("--thresholds", choices=("fixed", "adaptive"), default=defaults.thresholds,
                       help="clip thresholds: fixed, or adaptive (each group tracks a private "
                            "quantile of its per-sample norms; default: fixed)")
    train.add_argument("--target-quantile", type=float, default=defaults.target_quantile,
                       help="with --thresholds adaptive only: the quantile each threshold tracks "
                            "(default: 0.5)")
    train.add_argument("--quantile-lr", type=_positive_float, default=None,
                       help="with --thresholds adaptive only: η of the update C ← C·exp(−η(b̃ − q)) "
                            "(default: 0.3)")
    train.add_argument("--quantile-budget", type=_fraction, default=None,
                       help="with --thresholds adaptive only: the share of the budget spent on the "
                            "count releases; ε stays --epsilon (default: 0.01)")
    train.add_argument("--clip-gamma", type=_positive_float, default=None,
                       help="with --clipping auto-s only: γ of g/(‖g‖ + γ) (default: 0.01)")
    train.add_argument("--psac-r", type=_positive_float, default=None,
                       help="with --clipping psac only: r of DP-PSAC (default: 0.1)")
    train.add_argument("--noise-allocation", choices=NOISE_ALLOCATIONS, default=defaults.noise_allocation,
                       help="how the noise is spread over clip groups; same privacy (default: global)")
    train.add_argument("--optimizer", choices=list(OPTIMIZERS), default=None,
                       help=f"base optimizer (default: {defaults.optimizer}; adamw for text models)")
    train.add_argument("--lr", type=_learning_rate, default=None,
                       help="'auto' (the default): the optimizer's step size set from the released "
                            "gradients, at no ε; 'hyfreedp': HyFreeDP's learning rate from privatised "
                            "losses; or a number")
    train.add_argument("--lr-update-interval", type=_positive_int, default=None,
                       help="with --lr hyfreedp only: K, steps between learning-rate updates (default: 5)")
    train.add_argument("--accountant", choices=ACCOUNTANTS, default=defaults.accountant)
    train.add_argument("--seed", type=int, default=defaults.seed,
                       help="seed initialisation, sampling and noise for a reproducible run; anyone "
                            "who knows the seed can remove the noise (default: none, the OS's secure "
                            "source)")
    train.add_argument("--json", type=Path, help="write the result as JSON to this file")
    train.add_argument("--out", type=Path,
                       help="run directory for the model (model.pt, model.json), metrics.jsonl, report.json "
                            "and plots (default: none — the model is not saved, the output says so)")
    train.add_argument("--quiet", action="store_true", help="no progress bars")
    train.add_argument("--reference", action="store_true",
                       help="also train the same run without noise (same data, model and steps) and report "
                            "its test accuracy beside this run's: what the noise costs (outside the "
                            "guarantee: computed from the training rows without noise; twice the time)")
    train.add_argument("--audit-canaries", type=_positive_int, default=None, metavar="M",
                       help="audit this run: M gradient canaries ride along in the releases (no private "
                            "example touches them, so they cost no ε) and the result reports an empirical "
                            "lower bound on ε (one-run audit, docs/audit.md) (default: no audit)")
    train.add_argument("--nproc-per-node", type=_positive_int, default=1,
                       help="train in this many data-parallel processes on this machine, launched by "
                            "torchrun; same ε as one process (docs/distributed.md) (default: 1)")

    eps = commands.add_parser(
        "epsilon", help="privacy calculator: ε of a run, or σ for a target ε",
        description="ε of a DP-SGD run with Poisson sampling, or the noise multiplier for a target ε.")
    target = eps.add_mutually_exclusive_group(required=True)
    target.add_argument("--noise-multiplier", type=float, help="σ: print the ε it spends")
    target.add_argument("--target-epsilon", type=_positive_float, help="ε: print the σ needed")
    eps.add_argument("--sample-rate", type=float, required=True, help="Poisson sampling rate q")
    length = eps.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, help="number of steps")
    length.add_argument("--epochs", type=float,
                        help="number of epochs (steps = ⌈epochs·round(1/q)⌉, as in training)")
    eps.add_argument("--delta", type=_delta, required=True)
    eps.add_argument("--accountant", choices=ACCOUNTANTS, default="pld")
    text.add_arguments(train, _positive_int)
    predict.add_parser(commands)
    audit.add_parser(commands, _positive_float, _positive_int, _delta, _learning_rate)
    return root


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    """Train in this process, as one rank of a torchrun launch, or launch ``--nproc-per-node`` ranks."""
    from . import launch

    if launch.under_torchrun():
        with launch.process_group():
            return _train_in_this_process(args)
    if args.nproc_per_node > 1:
        launch.check_parallel_options(args.thresholds, args.lr, args.audit_canaries)
        return launch.launch(argv, args.nproc_per_node)
    return _train_in_this_process(args)


def _train_in_this_process(args: argparse.Namespace) -> int:
    from .launch import is_main_process
    from .report import accuracy_line, where_results_went, write_json
    from .training import TrainConfig, train

    if args.model not in MODELS:
        if args.reference:
            raise ValueError("--reference is offered for table and image models only: drop it")
        return text.command(args)
    text.check_no_text_flags(args)
    epochs = TrainConfig.epochs if args.epochs is None and args.steps is None else args.epochs
    config = TrainConfig(
        dataset=args.dataset, label_column=args.label_column or TrainConfig.label_column,
        model=args.model, hidden=args.hidden,
        schema=str(args.schema) if args.schema else None, labels=args.labels,
        numeric_scaling=args.numeric_scaling, na_values=args.na_values,
        drop_missing=args.drop_rows_with_missing, test_data=args.test_data,
        epsilon=args.epsilon, delta=args.delta, epochs=epochs, steps=args.steps,
        batch_size=args.batch_size,
        clipping=args.clipping, groups=args.groups, thresholds=args.thresholds,
        target_quantile=args.target_quantile, quantile_lr=args.quantile_lr,
        quantile_budget=args.quantile_budget, clip_gamma=args.clip_gamma, psac_r=args.psac_r,
        noise_allocation=args.noise_allocation, lr_update_interval=args.lr_update_interval,
        optimizer=args.optimizer or TrainConfig.optimizer,
        lr=TrainConfig.lr if args.lr is None else args.lr,
        accountant=args.accountant, seed=args.seed,
        audit_canaries=args.audit_canaries, reference=args.reference,
        out=str(args.out) if args.out else None, quiet=args.quiet)
    result = train(config)
    if not is_main_process():
        return 0
    if args.json:
        write_json(args.json, result)
    print(accuracy_line(result["test_accuracy"], result["test_majority_class"],
                        result["reference_test_accuracy"]))
    print(f"guarantee: {result['guarantee']}; randomness: {result['randomness']}")
    print(result["delta_choice"])
    print(f"learning rate: {result['learning_rate']}")
    if result["audit"]:
        found = result["audit"]
        print(f"audit: ε_LB {found['epsilon_lower_bound']:.3f} at {found['confidence']:.0%} confidence from "
              f"{found['canaries']} canaries (claimed ε {result['epsilon']:.3f}): {found['verdict']}")
    for note in result["data_notes"]:
        print(f"note: {note}")
    if result["note"]:
        print(f"note: {result['note']}")
    print(where_results_went(args.out, args.json, kind=result["dataset"]["kind"]))
    return 0


def _epsilon(args: argparse.Namespace) -> int:
    from ..privacy import MIN_NOISE_MULTIPLIER, epsilon, noise_multiplier, planned_steps
    from .training import loose_target_note

    if not 0 < args.sample_rate <= 1:
        raise ValueError(f"--sample-rate must be in (0, 1], got {args.sample_rate}")
    steps = planned_steps(args.epochs, args.steps, args.sample_rate)
    common: dict[str, Any] = {"sample_rate": args.sample_rate, "steps": steps, "delta": args.delta,
                              "accountant": args.accountant}
    if args.noise_multiplier is not None:
        value = epsilon(noise_multiplier=args.noise_multiplier, **common)
        print(f"epsilon {value:.6g} (σ = {args.noise_multiplier}, q = {args.sample_rate}, "
              f"{steps} steps, δ = {args.delta}, {args.accountant.upper()})")
    else:
        value = noise_multiplier(target_epsilon=args.target_epsilon, **common)
        print(f"noise multiplier {value:.6g} (ε = {args.target_epsilon}, q = {args.sample_rate}, "
              f"{steps} steps, δ = {args.delta}, {args.accountant.upper()})")
        if value <= MIN_NOISE_MULTIPLIER:  # the target is looser than the calibration's noise floor
            spent = epsilon(noise_multiplier=value, **common)
            print(f"note: {loose_target_note(args.target_epsilon, value, spent)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args, argv)
        return {"epsilon": _epsilon, "audit": audit.run, "predict": predict.run}[args.command](args)
    except (ValueError, OSError, RuntimeError, OverflowError, MemoryError) as error:
        if args.debug:
            raise
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"tunefree: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
