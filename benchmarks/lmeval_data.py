"""Documents in the schemas of real lm-eval datasets, for the task copies in benchmarks/lmeval_tasks/.

Everything is built from the repository's datasets/ (the Shakespeare texts of sample_texts.jsonl and the
questions of sample_choices.jsonl) with a seeded RNG: the same `docs` give the same files on every run, every
document of a split is distinct, and lengths are those of the real datasets (roughly):

| task | fields written | length |
| --- | --- | --- |
| hellaswag | ind, activity_label, ctx_a, ctx_b, ctx, endings, label ("0"-"3"), ... (*) | ctx ~40, 4 endings ~20 words |
| arc_easy | id, question, choices {text, label}, answerKey | question ~25 words, choices 1-6 words |
| winogrande | sentence (one "_"), option1, option2, answer ("1"/"2") | ~22 words |
| lambada_openai | text | ~75 words, scored: the last word |
| gsm8k | question, answer (steps with <<a*b=c>> and "#### N") | ~45 + ~40 words |
| mmlu | question, subject, choices (4), answer (0-3) | ~30 words, choices ~4 words |

(*) and source_id, split, split_type.

`write_all(folder, docs, subjects)` writes `<folder>/<task>/<split>.jsonl`, the paths the task copies name
with `@DATA@` (bench_lmeval.py replaces it with `folder`).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEED = 26  # issue 26

# the MMLU subjects of the task copies (lm-eval's names; 5 per category)
MMLU_SUBJECTS = {
    "stem": ["abstract_algebra", "anatomy", "astronomy", "college_physics", "computer_security"],
    "other": ["business_ethics", "clinical_knowledge", "global_facts", "marketing", "nutrition"],
    "social_sciences": ["econometrics", "high_school_geography", "public_relations", "sociology",
                        "us_foreign_policy"],
    "humanities": ["formal_logic", "jurisprudence", "philosophy", "prehistory", "world_religions"],
}


def _words() -> list[str]:
    words = []
    for line in (REPO / "datasets/sample_texts.jsonl").read_text().splitlines():
        text = json.loads(line)["text"]
        words += [w for w in re.split(r"\s+", text) if w and not w.isupper() and not re.fullmatch(r"[IVXLC]+\.", w)]
    return words


WORDS = _words()
CHOICE_ROWS = [json.loads(line) for line in (REPO / "datasets/sample_choices.jsonl").read_text().splitlines()]
PLAIN = sorted({re.sub(r"[^A-Za-z']", "", w).lower() for w in WORDS} - {""})  # single words, no punctuation
NOUNS = [w for w in PLAIN if re.fullmatch(r"[a-z]{5,}", w) and not w.endswith(("ly", "eth", "est", "st"))]


def span(rng: random.Random, n: int) -> str:
    i = rng.randrange(len(WORDS) - n)
    return " ".join(WORDS[i:i + n])


def distinct(make, n: int, rng: random.Random, key=None) -> list[dict]:
    """`n` documents from `make(rng, i)` with no two alike (by `key`, default the whole document)."""
    out, seen = [], set()
    while len(out) < n:
        doc = make(rng, len(out))
        k = json.dumps(key(doc) if key else doc, sort_keys=True)
        if k not in seen:
            seen.add(k)
            out.append(doc)
    return out


def hellaswag(rng: random.Random, i: int) -> dict:
    ctx_a, ctx_b = span(rng, rng.randint(25, 45)), span(rng, rng.randint(4, 10))
    endings = [span(rng, rng.randint(12, 28)) for _ in range(4)]
    label = rng.randrange(4)
    activity = " ".join(w.capitalize() for w in rng.sample(NOUNS, rng.randint(1, 3)))
    return {"ind": i, "activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}",
            "endings": endings, "source_id": f"shakespeare~{i}", "split": "val", "split_type": "indomain",
            "label": str(label)}


def arc(rng: random.Random, i: int) -> dict:
    stem = span(rng, rng.randint(15, 30))
    question = f"In the passage \"{stem}\", which words come next?"
    texts = [span(rng, rng.randint(1, 6)).strip(",.;:") or "none" for _ in range(4)]
    labels = ["A", "B", "C", "D"]
    return {"id": f"Shakespeare_{i:05d}", "question": question, "choices": {"text": texts, "label": labels},
            "answerKey": labels[rng.randrange(4)]}


def winogrande(rng: random.Random, i: int) -> dict:
    while True:
        words = span(rng, rng.randint(16, 28)).split()
        spots = [j for j, w in enumerate(words) if j > 2 and re.fullmatch(r"[a-z']{5,}", w)]
        if spots:
            break
    j = rng.choice(spots)
    true, other = words[j], rng.choice(NOUNS)
    words[j] = "_"
    options = [true, other] if rng.random() < 0.5 else [other, true]
    return {"sentence": " ".join(words), "option1": options[0], "option2": options[1],
            "answer": str(options.index(true) + 1)}


def lambada(rng: random.Random, i: int) -> dict:
    while True:  # the scored last word: letters, no punctuation after it (as in lambada_openai)
        text = span(rng, rng.randint(55, 95)).rstrip(",.;:!?'")
        if re.fullmatch(r"[A-Za-z']+", text.split(" ")[-1]):
            return {"text": text}


def gsm8k(rng: random.Random, i: int) -> dict:
    who, thing, other = (rng.choice(["Horatio", "Marcellus", "Bernardo", "Francisco", "Adonis", "Cytherea"]),
                         *rng.sample(NOUNS, 2))
    a, b, c, d = rng.randint(2, 40), rng.randint(2, 12), rng.randint(2, 30), rng.randint(1, 9)
    total = a * b
    left = total - c if total > c else total + c
    op = "sells" if total > c else "finds"
    final = left * d
    question = (f"{who} keeps {a} boxes of {thing}s and every box holds {b} {thing}s. On the way to the castle "
                f"{who} {op} {c} {thing}s near the {other}. Each {thing} that is left is traded for {d} "
                f"{other}s at the market. How many {other}s does {who} get in the end?")
    sign = "-" if total > c else "+"
    answer = (f"{who} starts with {a} * {b} = <<{a}*{b}={total}>>{total} {thing}s.\n"
              f"After that {who} has {total} {sign} {c} = <<{total}{sign}{c}={left}>>{left} {thing}s.\n"
              f"So {who} gets {left} * {d} = <<{left}*{d}={final}>>{final} {other}s.\n#### {final}")
    return {"question": question, "answer": answer}


def mmlu(subject: str):
    def make(rng: random.Random, i: int) -> dict:
        row = rng.choice(CHOICE_ROWS)
        if rng.random() < 0.5:  # a question of sample_choices.jsonl, with a passage before it
            q = row["context"].removeprefix("Question: ").removesuffix("\nAnswer: ").strip()
            question = f"{span(rng, rng.randint(10, 25))}\n{q}"
            choices, answer = list(row["choices"]), row["answer"]
            order = list(range(4))
            rng.shuffle(order)
            choices, answer = [choices[k] for k in order], order.index(answer)
        else:
            question = f"Which phrase follows \"{span(rng, rng.randint(15, 30))}\" in the text?"
            choices, answer = [span(rng, rng.randint(2, 7)) for _ in range(4)], rng.randrange(4)
        return {"question": question, "subject": subject, "choices": choices, "answer": answer}
    return make


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_all(folder: Path, docs: int, subjects: int = 20) -> None:
    """Every task's splits under `folder`; `docs` evaluated documents per task (MMLU: in all, over the subjects)."""
    shots = 20  # training splits lm-eval samples few-shot examples from
    for name, make, splits in [("hellaswag", hellaswag, ["train", "validation"]),
                               ("arc_easy", arc, ["train", "validation", "test"]),
                               ("winogrande", winogrande, ["train", "validation"]),
                               ("lambada_openai", lambada, ["test"]),
                               ("gsm8k", gsm8k, ["train", "test"])]:
        rng = random.Random(f"{SEED}-{name}")
        rows = distinct(make, shots * (len(splits) - 1) + docs, rng)
        for k, split in enumerate(splits):  # the evaluated split is the last, with `docs` rows
            part = rows[k * shots:(k + 1) * shots] if k < len(splits) - 1 else rows[k * shots:]
            _write(folder / name / f"{split}.jsonl", part)
    names = [s for group in MMLU_SUBJECTS.values() for s in group][:subjects]
    per = [docs // len(names) + (1 if k < docs % len(names) else 0) for k in range(len(names))]
    for subject, n in zip(names, per):
        rng = random.Random(f"{SEED}-mmlu-{subject}")
        rows = distinct(mmlu(subject), 5 + max(n, 1), rng)
        _write(folder / "mmlu" / f"{subject}_dev.jsonl", rows[:5])
        _write(folder / "mmlu" / f"{subject}_test.jsonl", rows[5:5 + max(n, 1)])
