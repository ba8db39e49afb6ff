"""Short product reviews generated offline: the text benchmarks' stand-in for real reviews (no download).

Each review is drawn for a label first (``positive_share`` of them positive), then written as 1–3 clauses
about the product's aspects and, often, a verdict. A clause agrees with the label with probability
``agreement`` and opposes it otherwise (mixed reviews: "the screen is great but the battery died in a
week"), so the words alone do not decide the label; negations flip or soften a clause ("not great", "not
bad", "never had an issue", "wouldn't recommend"), a contrast ("…, but …") puts the weight on its second
clause, and some reviews are only neutral filler with a short verdict. Finally ``label_noise`` of the labels
are flipped (a rating that disagrees with its own text, as real reviews have). Vocabulary, aspects and
filler differ by domain.

``DATASETS`` are the sets the text benchmarks use, each split 60/20/20 into train / validation / test by a
seeded permutation: choices are made on validation only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ASPECTS = {
    "electronics": ["battery life", "screen", "sound", "sound quality", "charger", "setup", "app",
                    "bluetooth connection", "build quality", "remote", "picture quality", "volume",
                    "charging cable", "speaker", "camera", "touchscreen", "wifi range", "interface"],
    "kitchen": ["lid", "handle", "nonstick coating", "blade", "motor", "size", "finish", "seal", "timer",
                "temperature control", "cleanup", "base", "pour spout", "glass", "thermostat", "cord"],
    "apparel": ["fit", "fabric", "material", "stitching", "color", "sizing", "zipper", "waistband",
                "sole", "lining", "print", "collar", "elastic", "buttons", "length", "pockets"],
    "books": ["plot", "writing", "ending", "characters", "pacing", "dialogue", "story", "narrator",
              "world building", "first half", "twist", "illustrations", "translation", "audio version"],
}
STRONG_POS = ["great", "excellent", "amazing", "fantastic", "perfect", "superb", "outstanding", "wonderful",
              "awesome", "brilliant", "solid", "impressive"]
WEAK_POS = ["good", "nice", "decent", "fine", "pretty good", "okay", "reliable", "sturdy", "comfortable",
            "clear", "well made", "easy"]
STRONG_NEG = ["terrible", "awful", "horrible", "useless", "garbage", "pathetic", "flimsy", "broken",
              "defective", "junk", "a joke", "a disaster"]
WEAK_NEG = ["disappointing", "mediocre", "cheap", "weak", "poor", "meh", "underwhelming", "subpar",
            "flimsy", "uncomfortable", "confusing", "slow"]
POS_VERBS = ["works perfectly", "does exactly what it says", "holds up well", "exceeded my expectations",
             "works like a charm", "still going strong", "was worth every penny", "feels premium",
             "arrived quickly and works", "is holding up after months", "made my life easier"]
NEG_VERBS = ["stopped working after a week", "broke the first time I used it", "died after three days",
             "fell apart", "arrived damaged", "never worked right", "started peeling", "keeps disconnecting",
             "is already falling apart", "was a waste of money", "gave out within a month"]
NEGATED_POS = ["the {a} is not great", "the {a} isn't very good", "the {a} is not what I expected",
               "nothing special about the {a}", "the {a} is not as described", "I wouldn't call the {a} good",
               "the {a} doesn't work well"]  # negative meaning
NEGATED_NEG = ["the {a} is not bad", "the {a} is not bad at all", "no complaints about the {a}",
               "no issues with the {a} so far", "never had a problem with the {a}", "can't fault the {a}",
               "the {a} doesn't disappoint"]  # positive meaning
VERDICT_POS = ["Highly recommend.", "Would buy again.", "Five stars.", "Love it!", "Very happy with it.",
               "Couldn't be happier.", "Great value.", "Totally worth it.", "Recommended.",
               "So glad I got it.", "I'd buy it again in a heartbeat."]
VERDICT_NEG = ["Returned it.", "Save your money.", "Would not recommend.", "One star.", "Avoid.",
               "Not worth the price.", "Very disappointed.", "Sending it back.", "Do not buy.",
               "Wouldn't buy again.", "Regret buying it."]
VERDICT_MILD = ["It's okay.", "Does the job.", "Meh.", "It's fine I guess.", "For the price it's fine.",
                "Could be better.", "Not sure yet."]
FILLER = {
    "electronics": ["Bought this for my son.", "Got it on sale.", "Using it in my home office.",
                    "Second one I've bought.", "Replaced my old one with this.", "Had it for two weeks now."],
    "kitchen": ["Bought it for our new apartment.", "Use it almost every day.", "Got this as a gift.",
                "My wife picked this one.", "Replaced an older model.", "Used it for a dinner party."],
    "apparel": ["Ordered my usual size.", "Bought it for a wedding.", "Wore it twice so far.",
                "Got it in black.", "Bought two of these.", "Ordered it for my husband."],
    "books": ["Read it on vacation.", "Picked it up after a friend's recommendation.", "Book club pick.",
              "Finished it in two days.", "Listened to it on my commute.", "Third book in the series."],
}
PRODUCT = {"electronics": ["this", "the device", "it", "the unit"], "kitchen": ["this", "the pan", "it",
           "this thing"], "apparel": ["this", "the shirt", "it", "the jacket"],
           "books": ["this book", "it", "the book", "this one"]}


def _clause(rng: random.Random, domain: str, positive: bool) -> str:
    """One clause of the given polarity about an aspect or the product."""
    aspect = rng.choice(ASPECTS[domain])
    thing = rng.choice(PRODUCT[domain])
    kind = rng.random()
    if kind < 0.45:
        words = (STRONG_POS if rng.random() < 0.5 else WEAK_POS) if positive else (
            STRONG_NEG if rng.random() < 0.5 else WEAK_NEG)
        return rng.choice([f"the {aspect} is {rng.choice(words)}", f"{rng.choice(words)} {aspect}",
                           f"{aspect} was {rng.choice(words)}", f"{thing} is {rng.choice(words)}"])
    if kind < 0.7:
        return f"{rng.choice([thing, 'the ' + aspect])} {rng.choice(POS_VERBS if positive else NEG_VERBS)}"
    if kind < 0.9:  # negation carries the polarity
        return rng.choice(NEGATED_NEG if positive else NEGATED_POS).format(a=aspect)
    mild = rng.choice(WEAK_POS if positive else WEAK_NEG)
    return f"{aspect} is {rng.choice(['kind of', 'fairly', 'somewhat', 'a bit'])} {mild}"


def review(rng: random.Random, domain: str, positive: bool, agreement: float) -> str:
    parts = []
    if rng.random() < 0.35:
        parts.append(rng.choice(FILLER[domain]))
    clauses = [_clause(rng, domain, positive if rng.random() < agreement else not positive)
               for _ in range(rng.choice([1, 1, 2, 2, 3]))]
    if len(clauses) >= 2 and rng.random() < 0.5:  # a contrast: the second clause says what counts
        clauses[-2:] = [f"{clauses[-2]}, but {clauses[-1]}"]
    parts += [c[0].upper() + c[1:] + rng.choice([".", ".", "!", ""]) for c in clauses]
    verdict = rng.random()
    if verdict < 0.55:
        agrees = rng.random() < agreement + (1 - agreement) / 2
        parts.append(rng.choice(VERDICT_POS if positive == agrees else VERDICT_NEG))
    elif verdict < 0.7:
        parts.append(rng.choice(VERDICT_MILD))
    text = " ".join(p for p in parts if p)
    if rng.random() < 0.15:
        text = text.lower()
    return text


@dataclass(frozen=True)
class ReviewSet:
    """A generated data set: its domain, size, share of positive labels, how often a clause agrees with
    its review's label, the share of flipped labels and its seed."""

    name: str
    domain: str
    rows: int
    positive_share: float
    agreement: float
    label_noise: float
    seed: int

    def rows_and_labels(self) -> tuple[list[str], list[int]]:
        rng = random.Random(self.seed)
        texts, labels = [], []
        for _ in range(self.rows):
            positive = rng.random() < self.positive_share
            texts.append(review(rng, self.domain, positive, self.agreement))
            labels.append(int(positive) if rng.random() >= self.label_noise else int(not positive))
        return texts, labels

    def splits(self) -> dict[str, list[int]]:
        """Row indices of train / valid / test (60/20/20, a permutation seeded by the set's seed)."""
        order = list(range(self.rows))
        random.Random(self.seed + 1).shuffle(order)
        a, b = int(0.6 * self.rows), int(0.8 * self.rows)
        return {"train": order[:a], "valid": order[a:b], "test": order[b:]}


DATASETS = {
    s.name: s for s in [
        ReviewSet("electronics-3k", "electronics", 3000, 0.70, 0.72, 0.06, 11),
        ReviewSet("kitchen-2k", "kitchen", 2000, 0.75, 0.75, 0.08, 12),
        ReviewSet("apparel-5k", "apparel", 5000, 0.65, 0.70, 0.05, 13),
        ReviewSet("books-1k", "books", 1200, 0.70, 0.75, 0.06, 14),
        ReviewSet("electronics-4k-clear", "electronics", 4000, 0.70, 0.85, 0.04, 15),
    ]
}


if __name__ == "__main__":  # a look at a few reviews of each set
    for data in DATASETS.values():
        texts, labels = data.rows_and_labels()
        print(f"{data.name}: {sum(labels) / len(labels):.2f} positive")
        for text, label in list(zip(texts, labels))[:6]:
            print(f"  {label} {text}")
