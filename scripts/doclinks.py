#!/usr/bin/env python3
"""Checks the documentation's internal links, so a moved section or a renamed
chapter fails the test command instead of leaving a reader at a dead end.

- Every relative link in README.md, ARCHITECTURE.md, CHANGELOG.md and the
  book's chapters (docs/src) names a file that exists and, with `#anchor`, a
  heading of that file (anchors as mdBook makes them).
- Every chapter is in docs/src/SUMMARY.md (mdBook renders nothing else) and
  in examples/src/lib.rs's `book` module (so its Rust examples compile as
  doctests).

Exits 1 listing every problem; prints one summary line otherwise.
"""

import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
SRC = os.path.join(ROOT, "docs", "src")

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(path):
    """The lines of `path` outside code fences, inline code removed."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                yield number, re.sub(r"`[^`]*`", "``", line)


def anchor(text):
    """mdBook's id for a heading: its text, lower case, spaces as `-`,
    anything but letters, digits, `_` and `-` dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("`", "").replace("*", "")
    out = []
    for ch in text:
        if ch.isalnum() or ch in "_-":
            out.append(ch.lower())
        elif ch.isspace():
            out.append("-")
    return "".join(out)


def anchors(path):
    found = set()
    fenced = False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            m = None if fenced else HEADING.match(line)
            if m:
                base = anchor(m.group(2))
                name, n = base, 1
                while name in found:
                    name, n = f"{base}-{n}", n + 1
                found.add(name)
    return found


def main():
    problems = []
    chapters = sorted(f for f in os.listdir(SRC) if f.endswith(".md"))
    files = [os.path.join(ROOT, f) for f in ("README.md", "ARCHITECTURE.md", "CHANGELOG.md")]
    files += [os.path.join(SRC, f) for f in chapters]
    links = 0
    for path in files:
        rel = os.path.relpath(path, ROOT)
        for number, line in prose_lines(path):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue
                links += 1
                file, _, frag = target.partition("#")
                dest = path if not file else os.path.normpath(
                    os.path.join(os.path.dirname(path), file))
                if not os.path.exists(dest):
                    problems.append(f"{rel}:{number}: {target}: no such file")
                elif frag and dest.endswith(".md") and frag not in anchors(dest):
                    problems.append(f"{rel}:{number}: {target}: no heading #{frag}")

    summary = open(os.path.join(SRC, "SUMMARY.md"), encoding="utf-8").read()
    listed = set(re.findall(r"\]\(([^)]+\.md)\)", summary))
    doctested = open(os.path.join(ROOT, "examples", "src", "lib.rs"), encoding="utf-8").read()
    for chapter in chapters:
        if chapter == "SUMMARY.md":
            continue
        if chapter not in listed:
            problems.append(f"docs/src/{chapter}: not in SUMMARY.md")
        if f'include_str!("../../docs/src/{chapter}")' not in doctested:
            problems.append(f"docs/src/{chapter}: not in examples/src/lib.rs's book module")

    if problems:
        print("\n".join(problems), file=sys.stderr)
        print(f"doclinks: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"doclinks: {links} links in {len(files)} files, {len(chapters) - 1} chapters: all resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
