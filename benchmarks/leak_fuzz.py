"""The leak fuzzer's long run: many seeds, each finding shrunk to a minimal reproducer, a table of the
findings by the invariant they break, and the refusals of draws that contain nothing that leaks.

Every draw (an ordinary model and private training loop, ``tests/support/fuzz_draw.py``) must be exact
under the multi-step neighbour test or refused (``tests/support/leak_fuzz.py`` says what is checked); leaks
that the run's random checks missed by chance (``random-check``) are counted apart. One thread:

    OMP_NUM_THREADS=1 python benchmarks/leak_fuzz.py --seeds 0:2000 --out findings.md
    OMP_NUM_THREADS=1 python benchmarks/leak_fuzz.py --seeds 0:500 --outside   # also user errors no
                                                                                # invariant can see
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.fuzz_zoo import UNSEEN_STATE  # noqa: E402
from support.leak_fuzz import (  # noqa: E402
    CLASSES,
    RANDOM_CHECK,
    Outcome,
    check,
    fuzz,
    leak_features,
    reproducer,
    shrink_outcome,
    simpler,
)


def _blank(message: str) -> str:
    """A message with names and numbers blanked, so that one cause is one group."""
    return re.sub(r"\d+", "#", re.sub(r"'[^']*'", "'…'", message))[:90]


def _refusal_kind(outcome: Outcome) -> str:
    return _blank(outcome.refusal or "")


def _seeds(text: str) -> range:
    start, _, stop = text.partition(":")
    return range(int(start), int(stop)) if stop else range(int(start), int(start) + 1)


def _traits(outcome: Outcome) -> list[str]:
    """What a finding may be shrunk around: each leak feature of its draw, or (none) the message of a
    crash with names and numbers blanked, or "–" for a finding with neither."""
    crashes = [_blank(v.detail) for v in outcome.violations if v.check == "crash"]
    return crashes or leak_features(outcome.draw) or ["–"]


def _needs(small: Outcome, trait: str, group) -> bool:
    """Whether the minimal draw needs ``trait``: no simplification that drops it keeps the draw in its
    group (a trait that rode along with the cause is not a reproducer of its own)."""
    for draft in simpler(small.draw):
        got = check(draft)
        if trait not in _traits(got) and got.verdict == small.verdict and group(got) == group(small):
            return False
    return True


def _shrunk(outcomes: list[Outcome], per_group: int, budget: int, key) -> dict[str, list[Outcome]]:
    """Per group (``key``), the ``per_group`` most frequent traits (``_traits``), each shrunk from its
    first outcome to a minimal draw that keeps the trait; distinct minimal draws that need their trait
    only."""
    groups: dict[str, list[Outcome]] = collections.defaultdict(list)
    for outcome in outcomes:
        groups[key(outcome)].append(outcome)
    minimal: dict[str, list[Outcome]] = {}
    for group, members in groups.items():
        counts = collections.Counter(t for o in members for t in _traits(o))
        seen, kept = set(), []
        for trait, _ in counts.most_common(per_group):
            first = min((o for o in members if trait in _traits(o)), key=lambda o: len(_traits(o)))
            small = shrink_outcome(first, budget, keep=lambda o, t=trait: t in _traits(o))
            name = repr(small.draw.model) + repr(small.draw.loop)
            if name not in seen and (trait == "–" or _needs(small, trait, key)):
                seen.add(name)
                kept.append(small)
            print(f"  shrunk seed {first.draw.seed} ({trait}): {small.draw!r}", flush=True)
        minimal[group] = kept
    return minimal


def _table(outcomes: list[Outcome], minimal: dict[str, list[Outcome]]) -> list[str]:
    lines = ["| invariant broken | findings | distinct minimal reproducers (of those shrunk) "
             "| worst distance / R | random-check (unchecked step / random half) |",
             "|---|---:|---:|---:|---:|"]
    for cls in CLASSES:
        members = [o for o in outcomes if o.verdict == "finding" and o.invariant == cls]
        chance = [o for o in outcomes if o.verdict == RANDOM_CHECK and o.invariant == cls]
        ratios = [v.ratio for o in members for v in o.violations if v.ratio is not None
                  and v.check == "sensitivity"]
        worst = f"{max(ratios):.3g}" if ratios else "–"
        missed = collections.Counter(o.missed for o in chance)
        split = f"{len(chance)} ({missed['unchecked step']} / {missed['random half']})" if chance else "0"
        lines.append(f"| {cls} | {len(members)} | {len(minimal.get(cls, []))} | {worst} | {split} |")
    return lines


def issue29_pieces(outcome: Outcome) -> list[str]:
    """The pieces of the classes a held-out red team found leaking (issue 29) in a draw, leaking or not:
    state kept on the class, on foreign objects, in long lists, deques and globals (written or only read);
    gradients rescaled by a statistic of the batch or of each example (a tensor hook, a Function, a full
    backward hook); token means and target standardisation over the batch or per example; the clip
    functions of an extension; the samplers under ``poisson_sampling=False``."""
    spec, loop = outcome.draw.model, outcome.draw.loop
    found = [f"{b.kind} ({'written' if b.kwargs().get('update', True) else 'only read'})"
             for b in spec.blocks if b.kind in UNSEEN_STATE]
    mean = " (mean loss)" if (loop.declared or loop.reduction) == "mean" else ""
    found += [f"grad_scale {b.kwargs().get('how', 'tensor-hook')} per {b.kwargs().get('over', 'batch')}{mean}"
              for b in spec.blocks if b.kind == "grad_scale"]
    found += [f"{h.kind} hook{mean}" for h in spec.hooks if h.kind.startswith("backward_clip")]
    found += [f"token mean per {loop.token_mean}"] if loop.loss == "token-ce" else []
    found += [f"targets standardised per {loop.target_norm}"] if loop.target_norm else []
    found += [f"clipping={loop.clipping}"] if loop.clipping.startswith("fuzz-") else []
    found += [f"sampler={loop.sampler}"] if loop.sampler else []
    return sorted(set(found))


def _pieces_table(outcomes: list[Outcome]) -> list[str]:
    """Per piece of issue 29's classes: how the draws that contain it came out (a draw may hold several
    pieces, and other leak features)."""
    by_piece: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    findings: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for outcome in outcomes:
        for piece in issue29_pieces(outcome):
            by_piece[piece][outcome.verdict] += 1
            if outcome.verdict == "finding":
                findings[piece][outcome.invariant] += 1
    if not by_piece:
        return []
    lines = ["## The pieces of issue 29's classes", "",
             "| piece | draws | exact | refused | finding | random-check | invalid | findings by class |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for piece in sorted(by_piece):
        c = by_piece[piece]
        classes = ", ".join(f"{cls} {n}" for cls, n in findings[piece].most_common()) or "–"
        lines.append(f"| {piece} | {sum(c.values())} | {c['exact']} | {c['refused']} | {c['finding']} "
                     f"| {c[RANDOM_CHECK]} | {c['invalid']} | {classes} |")
    return lines + [""]


def _random_checks(outcomes: list[Outcome]) -> list[str]:
    chance = [o for o in outcomes if o.verdict == RANDOM_CHECK]
    if not chance:
        return []
    ratios = sorted(o.ratio for o in chance)
    return ["## Random-check leaks", "",
            f"{len(chance)} draws leaked through mixing on a step the run did not check, or that its random "
            "half missed, and are refused (or exact) when every step is checked on every pair: the "
            "detection probability docs/refusals.md states, counted apart from findings. Distance / R: "
            f"median {ratios[len(ratios) // 2]:.3g}, worst {ratios[-1]:.3g}. Seeds: "
            + ", ".join(str(o.draw.seed) for o in chance[:40]) + (" …" if len(chance) > 40 else ""), ""]


def _listing(outcomes: list[Outcome]) -> list[str]:
    """Every finding: seed, class, what was seen, the leak features of its draw."""
    findings = [o for o in outcomes if o.verdict == "finding"]
    return [f"- {o.draw.seed} [{o.invariant}] {'; '.join(f'{v.check}: {v.detail}' for v in o.violations)} "
            f"— {', '.join(leak_features(o.draw)) or 'no leak feature'}" for o in findings] + [""]


def report(outcomes: list[Outcome], minimal: dict[str, list[Outcome]], refusals: dict[str, list[Outcome]],
           command: str, fuzz_seconds: float, shrink_seconds: float) -> str:
    verdicts = collections.Counter(o.verdict for o in outcomes)
    lines = [f"Command: `{command}` ({torch.get_num_threads()} thread; the draws {fuzz_seconds:.0f} s, "
             f"{fuzz_seconds / max(len(outcomes), 1):.2f} s a draw; shrinking {shrink_seconds:.0f} s)", "",
             f"Draws: {len(outcomes)} — " + ", ".join(f"{k} {v}" for k, v in verdicts.most_common()), "",
             *_table(outcomes, minimal), "", *_pieces_table(outcomes), *_random_checks(outcomes),
             "## Findings", "", *_listing(outcomes), "## Minimal reproducers", ""]
    for cls, members in minimal.items():
        lines += [f"### {cls}", ""]
        for outcome in members:
            lines += [f"- {'; '.join(f'{v.check}: {v.detail}' for v in outcome.violations)}", "",
                      "  ```python", *("  " + t for t in reproducer(outcome.draw).splitlines()), "  ```", ""]
    split = [o for o in outcomes if o.split_refusal]
    if split:
        lines += ["## Refusals that depend on one example", "",
                  f"{len(split)} draws ran to the end on D but were refused on some D∖{{j}}: whether the run "
                  "is refused then tells whether example j was there (a side channel; the released steps "
                  "of the runs that both made were compared as usual). The first ones:", "",
                  *(f"- `{o.draw!r}`" for o in split[:5]), ""]
    if refusals:
        lines += ["## Refusals of draws with nothing that leaks", "",
                  "Each refusal below stops code whose draw has no leak feature (`leak_fuzz.leak_features`): "
                  "not a leak, but training refused that plain PyTorch runs. Minimal draws:", ""]
        for message, members in refusals.items():
            lines += [f"- `{message}`", *(f"  - `{o.draw!r}`" for o in members), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0:2000", help="START:STOP (default 0:2000)")
    parser.add_argument("--outside", action="store_true",
                        help="also draw user errors no invariant can see (docs/refusals.md)")
    parser.add_argument("--shrink-per-class", type=int, default=4)
    parser.add_argument("--shrink-budget", type=int, default=120, help="checks per shrink")
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()

    def progress(outcome: Outcome) -> None:
        if outcome.verdict in ("finding", RANDOM_CHECK):
            print(f"{outcome.draw.seed} ({outcome.verdict}): {outcome.line()}", flush=True)

    outcomes = fuzz(_seeds(args.seeds), progress, outside=args.outside)
    fuzz_seconds = time.perf_counter() - start
    print(collections.Counter(o.verdict for o in outcomes), f"{fuzz_seconds:.0f} s", flush=True)
    findings = [o for o in outcomes if o.verdict == "finding"]
    minimal = _shrunk(findings, args.shrink_per_class, args.shrink_budget, key=lambda o: o.invariant)
    harmless = [o for o in outcomes if o.verdict == "refused" and not leak_features(o.draw)]
    refusals = _shrunk(harmless, 2, args.shrink_budget, key=_refusal_kind)
    text = report(outcomes, minimal, refusals, "python benchmarks/leak_fuzz.py " + " ".join(sys.argv[1:]),
                  fuzz_seconds, time.perf_counter() - start - fuzz_seconds)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
