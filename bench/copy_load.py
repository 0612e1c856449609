#!/usr/bin/env python3
"""A copy-heavy load: "rename this variable in the following code", on code from the Python standard library.

Code edits repeat their input almost verbatim, the traffic speculative decoding by reference
(``plugins/llma``) is made for. Each request carries a different piece of CPython's own sources
(the ``.py`` files of the running interpreter's standard library, so it needs no network and is the
same on every machine with the same Python minor version): whole top-level functions and classes
packed into a passage of ``--min-tokens``..``--max-tokens`` tokens (default 200-800, counted as
characters / 4), and asks to rename one of its identifiers (the most frequent local name of 3+
characters that is not a keyword or builtin) and print the whole code back.

    python bench/copy_load.py --print 3          # show three prompts
    from copy_load import make_prompts           # bench/spec_bench.py draws its copy-heavy load here
"""

from __future__ import annotations

import argparse
import ast
import builtins
import io
import keyword
import random
import sysconfig
import tokenize
from collections import Counter
from pathlib import Path

INSTRUCTION = ("Rename the variable `{old}` to `{new}` in the following Python code. Reply with the complete "
               "code and nothing else.\n\n```python\n{code}\n```")
SKIP = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}


def stdlib_blocks() -> list[str]:
    """The top-level function and class definitions of the standard library's modules, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    blocks: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.end_lineno is not None:
                blocks.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    return blocks


def rename_target(code: str) -> str | None:
    """The most frequent identifier of 3+ characters in ``code`` that is not a keyword, builtin or self."""
    names: Counter[str] = Counter()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.NAME and len(tok.string) >= 3 and tok.string not in SKIP:
                names[tok.string] += 1
    except (tokenize.TokenError, IndentationError):
        return None
    return names.most_common(1)[0][0] if names else None


def make_prompts(n: int, seed: int = 0, min_tokens: int = 200, max_tokens: int = 800) -> list[str]:
    """``n`` distinct rename requests over passages of ``min_tokens``..``max_tokens`` tokens (chars / 4).

    Blocks are taken in a shuffled order; one that would overflow the passage is skipped, so a pass can run out of
    blocks before ``n`` prompts (seed 1 made 27 of 48): later passes take the blocks in new orders (new passages),
    and the first pass's prompts are what they always were."""
    blocks = [b for b in stdlib_blocks() if len(b) <= 4 * max_tokens]
    rng = random.Random(seed)
    order = list(range(len(blocks)))
    rng.shuffle(order)
    prompts: list[str] = []
    i, passes = 0, 1
    while len(prompts) < n:
        if i >= len(order):  # a pass over the blocks skips many that do not fit: another pass, in a new order
            if passes == 8:
                break
            rng.shuffle(order)
            i, passes = 0, passes + 1
        want = 4 * rng.randint(min_tokens, max_tokens)
        parts: list[str] = []
        while i < len(order) and sum(len(p) for p in parts) < want:
            block = blocks[order[i]]
            i += 1
            if sum(len(p) for p in parts) + len(block) <= 4 * max_tokens:
                parts.append(block)
        code = "\n\n\n".join(parts)
        old = rename_target(code)
        if old is None or len(code) < 4 * min_tokens:
            continue
        prompts.append(INSTRUCTION.format(old=old, new="renamed_" + old, code=code))
    if len(prompts) < n:
        raise RuntimeError(f"only {len(prompts)} copy prompts could be made from the standard library")
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--print", type=int, default=2, help="how many prompts to show")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    for p in make_prompts(a.print, a.seed):
        print(p, "\n" + "=" * 80)


if __name__ == "__main__":
    main()
