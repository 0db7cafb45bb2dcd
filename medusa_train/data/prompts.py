"""Prompt pools: the prompts replies are distilled from and benchmarks are run on. `load_prompts` reads any
dataset's first user turns (or this offline pool, `default`); `exclude_prompts` drops benchmark prompts from a pool.

The offline default prompt pool is a prompt set the project writes itself, so the main job needs no data.

Heads learn the target's habits, so the pool should look like what users ask a chat model: explanations,
writing, advice, comparisons, role play, short maths and code. We build it from task templates x topics,
plus generated arithmetic and word problems and small coding tasks; every prompt is deterministic (no
randomness that depends on the machine), and ids are a hash of the text, so a resumed distillation
recognises finished prompts even if the list grows.

Held out: a tenth of the topics, some coding tasks and some maths never appear in the `train` split;
prompts built from them form the `heldout` split, which the main job benchmarks on when MT-Bench is not
on disk. So benchmark prompts never leak into the heads' training data.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from ..config import DataConfig
from ..base.errors import ConfigError

Split = Literal["train", "heldout", "all"]

TOPICS = [
    "renewable energy", "the Roman Empire", "photosynthesis", "remote work", "learning a second language",
    "climate change", "personal budgeting", "healthy sleep habits", "the stock market", "artificial intelligence",
    "volcanoes", "the human immune system", "electric cars", "social media", "the Renaissance", "coffee",
    "black holes", "recycling", "time management", "public speaking", "the Great Wall of China", "vaccines",
    "honeybees", "the history of the Internet", "chess", "meditation", "urban gardening", "the water cycle",
    "the Second World War", "cryptocurrency", "marathon training", "plastic in the oceans", "the printing press",
    "quantum computing", "a healthy breakfast", "job interviews", "dinosaurs", "the Olympic Games",
    "the solar system", "democracy", "inflation", "video games", "jazz", "cloud computing", "rainforests",
    "nuclear power", "the French Revolution", "friendship", "the Moon landing", "baking bread",
    "the theory of evolution", "mobile phones", "the Amazon river", "earthquakes", "minimalism",
    "online privacy", "the Industrial Revolution", "yoga", "space exploration", "the human brain",
    "electric guitars", "ancient Egypt", "composting", "team sports", "machine translation", "coral reefs",
    "the history of money", "open-source software", "procrastination", "wind turbines", "Shakespeare",
    "the Silk Road", "DNA", "self-driving cars", "rock climbing", "antibiotics", "the Cold War",
    "smart homes", "volunteering", "street food", "the metric system", "tea ceremonies", "hurricanes",
    "impressionist painting", "3D printing", "starting a small business", "migratory birds", "board games",
    "cybersecurity", "the periodic table",
]

TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short blog post about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Give me five interesting facts about {t}.",
    "Write a short poem about {t}.",
    "Summarize the most important ideas about {t} in three bullet points.",
    "What are some common misconceptions about {t}?",
    "Write a persuasive paragraph arguing that everyone should learn about {t}.",
    "Imagine you are a museum guide. Introduce an exhibition about {t} to a group of visitors.",
    "Write a short dialogue between a teacher and a curious student about {t}.",
    "What questions should I ask an expert on {t}, and why?",
    "How has {t} changed over the last hundred years?",
    "Draft a short professional email to my team proposing a lunch-and-learn session on {t}.",
    "Write a very short story in which {t} plays an important role.",
    "I am a complete beginner. How should I start learning about {t}?",
    "Describe {t} in exactly three sentences.",
]

COMPARE = "Compare {t} and {u}: how are they similar, and how do they differ?"

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a sentence", "removes duplicates from a list while keeping the order",
    "computes the factorial of a number", "checks whether a word is a palindrome",
    "merges two sorted lists into one sorted list", "finds the largest element of a list",
    "converts a temperature from Celsius to Fahrenheit", "returns the most common word in a text",
    "computes the greatest common divisor of two integers", "flattens a nested list",
    "checks whether two strings are anagrams", "sorts a list of dictionaries by a given key",
    "counts how many times each character appears in a string", "implements binary search on a sorted list",
    "validates an email address with a regular expression", "reads a CSV file and prints the sum of a column",
    "returns all prime numbers below n", "converts a Roman numeral to an integer",
    "capitalizes the first letter of every word", "computes the average of a list of numbers",
    "rotates a list by k positions", "transposes a matrix",
]
CODE_LANGS = ["Python", "JavaScript", "C++"]
CODE_TEMPLATES = ["Write a {lang} function that {task}.", "How would you write code in {lang} that {task}? "
                                                              "Explain your solution briefly."]

HELDOUT_EVERY = 10  # every 10th topic / coding task is held out


def _id(text: str) -> str:
    return "default-" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]


def _maths(rng: random.Random, n: int) -> list[str]:
    """Arithmetic and word problems with fixed pseudo-random numbers."""
    out = []
    for i in range(n):
        a, b, c = rng.randint(12, 99), rng.randint(3, 49), rng.randint(100, 999)
        kind = i % 6
        if kind == 0:
            out.append(f"What is {a} * {b}? Show your work step by step.")
        elif kind == 1:
            out.append(f"Solve for x: {b}x + {a} = {c}. Explain each step.")
        elif kind == 2:
            out.append(f"What is {b}% of {c}? Explain how you calculated it.")
        elif kind == 3:
            out.append(f"A train travels at {a} km per hour for {b % 9 + 2} hours. How far does it go?")
        elif kind == 4:
            out.append(f"Sarah has {c} apples. She gives {a} to her friends and buys {b} more. "
                       "How many apples does she have now?")
        else:
            out.append(f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?")
    return out


def _build() -> tuple[list[str], list[str]]:
    train: list[str] = []
    held: list[str] = []
    for i, t in enumerate(TOPICS):
        dest = held if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else train
        dest += [tpl.format(t=t) for tpl in TEMPLATES]
    train_topics = [t for i, t in enumerate(TOPICS) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    for i, t in enumerate(train_topics):  # each topic compared with a fixed, different partner
        train.append(COMPARE.format(t=t, u=train_topics[(i * 7 + 3) % len(train_topics)]))
    for i, task in enumerate(CODE_TASKS):
        dest = held if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else train
        dest += [tpl.format(lang=lang, task=task) for lang in CODE_LANGS for tpl in CODE_TEMPLATES]
    maths = _maths(random.Random(1234), 240)
    train += maths[:-24]
    held += maths[-24:]
    # a fixed shuffle, so that any prefix (distill --limit) mixes every kind of task
    random.Random(0).shuffle(train)
    random.Random(1).shuffle(held)
    seen = set(train)
    held = [h for h in dict.fromkeys(held) if h not in seen]
    return list(dict.fromkeys(train)), held


def default_prompts(split: Split = "train") -> list[tuple[str, str]]:
    """(id, prompt) pairs of the offline pool: `train` (~1,700 prompts for self-distillation), `heldout`
    (~200 prompts on topics and tasks that `train` never uses, for benchmarks), or `all`."""
    train, held = _build()
    texts = {"train": train, "heldout": held, "all": train + held}[split]
    return [(_id(t), t) for t in texts]


# ---------------------------------------------------------------------------------------------------
# Pools read from a dataset


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    later: tuple[str, ...] = ()
    """The user turns that follow `text` in a multi-turn source (what `distill --turns all` answers in turn)."""


def _row_id(row: dict, index: int, prefix: str) -> str:
    for key in ("id", "question_id", "uid", "prompt_id"):
        if row.get(key) is not None and str(row[key]).strip():
            return str(row[key])
    return f"{prefix}-{index}"


def _user_turns(row: dict) -> list[str]:
    """Every user turn of a row (MT-Bench `turns`, a conversation's user messages, or its prompt)."""
    from .formats import prompt_of, rows_to_messages

    if isinstance(row.get("turns"), list):
        return [t for t in row["turns"] if isinstance(t, str) and t.strip()]
    try:
        msgs = rows_to_messages(row) or []
    except ConfigError:
        msgs = []
    turns = [m["content"] for m in msgs if m["role"] == "user" and m["content"].strip()]
    if not turns and (p := prompt_of(row)):
        turns = [p]
    return turns


def _load_rows(source: str) -> list[dict]:
    from .rows import load_raw

    return list(load_raw(DataConfig(dataset=source)))


def load_prompts(source: str) -> list[Prompt]:
    """The pool named by `source`: `default` (the offline pool) or a dataset; first user turns, non-blank,
    first occurrence of each distinct text, each with the user turns that follow it in its row (`later`). Ids come
    from the row (`id`, `question_id`, `uid`) or its index."""
    if source == "default":
        return [Prompt(i, t) for i, t in default_prompts("train")]
    from .formats import prompt_of

    rows = _load_rows(source)
    prefix = Path(source).stem if Path(source).exists() else source.replace("/", "_")
    seen: set[str] = set()
    out = []
    for i, row in enumerate(rows):
        text = prompt_of(row)
        if text is None or text in seen:
            continue
        seen.add(text)
        turns = _user_turns(row)
        later = tuple(turns[1:]) if turns and turns[0].strip() == text.strip() else ()
        out.append(Prompt(_row_id(row, i, prefix), text, later))
    if not out:
        raise ConfigError(f"--prompts {source}: no row holds a prompt (looked for messages, conversations, "
                          "prompt/question/instruction and turns columns)")
    return out


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def exclude_prompts(prompts: list[Prompt], exclude_files: Iterable[str], min_contained: int = 40) -> list[Prompt]:
    """Drop prompts equal (up to case and whitespace) to any user turn in `exclude_files`, or containing
    one of at least `min_contained` characters (a benchmark question pasted into a longer prompt)."""
    banned: set[str] = set()
    for f in exclude_files:
        for row in _load_rows(f):
            banned.update(_normalise(t) for t in _user_turns(row))
    long_banned = [b for b in banned if len(b) >= min_contained]
    keep = []
    for p in prompts:
        n = _normalise(p.text)
        if n in banned or any(b in n for b in long_banned):
            continue
        keep.append(p)
    return keep
