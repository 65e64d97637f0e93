#!/usr/bin/env python3
"""The workspace's shape, checked (scripts/test.sh runs it; ARCHITECTURE.md
says why each rule is there).

1. Size: no source file of a library crate holds more than 600 lines of
   non-test code (the lines before its `#[cfg(test)]` module). A file may be
   listed in OVERSIZE with a count it may not exceed (a ratchet, for one that
   cannot be split at once); an entry that grew, or that is back under the
   limit and still listed, fails.
2. dedup-kafka's layers: its top-level modules (a file or a folder of src/)
   import each other without a cycle, and
   - the runtimes, database/ and transactional/, never import each other;
   - pipeline/ imports neither runtime nor the relay;
   - the shared root (the other top-level files) imports no runtime folder
     and not the relay.
   An import is a `crate::` or `super::` path in code (comments and test
   modules aside), resolved through the crate root's re-exports.

3. ARCHITECTURE.md is a true map: every source file it names (`a.rs`,
   `folder/b.rs`) exists (in a library crate, tests/ or bench/), and every library source file
   with more than MAPPED lines of non-test code is named on it (by its own
   name, or as its folder for a `mod.rs`).

Exits non-zero, naming every breach, if any rule is broken.
"""

import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), ".."))
LIBRARY_CRATES = [
    "dedup-ttl",
    "dedup-core",
    "dedup-macros",
    "dedup-sql",
    "dedup-postgres",
    "dedup-sqlite",
    "dedup-mysql",
    "dedup-kafka",
    "dedup-registry",
    "dedup-cli",
]
LIMIT = 600
# Files not yet split, each with the non-test lines it may not exceed (none
# now: add one only with a reason, and split it soon).
OVERSIZE = {}

# Library files longer than this (non-test lines) are on ARCHITECTURE.md.
MAPPED = 250

RUNTIMES = {"database", "transactional"}
RELAY = "relay"
PIPELINE = "pipeline"


def non_test_lines(text):
    """Lines before the file's test module (all of them if it has none)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("#[cfg(test)]"):
            return i
    return len(lines)


def check_sizes():
    breaches = []
    seen = set()
    for crate in LIBRARY_CRATES:
        for folder, _, files in os.walk(os.path.join(ROOT, crate, "src")):
            for name in files:
                if not name.endswith(".rs"):
                    continue
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)
                with open(path, encoding="utf-8") as f:
                    n = non_test_lines(f.read())
                allowed = OVERSIZE.get(rel)
                if allowed is not None:
                    seen.add(rel)
                    if n > allowed:
                        breaches.append(
                            f"{rel}: {n} lines of non-test code, more than the {allowed} it "
                            f"had when listed: split it instead of growing it"
                        )
                    elif n <= LIMIT:
                        breaches.append(
                            f"{rel}: {n} lines now, within {LIMIT}: drop it from OVERSIZE "
                            f"in scripts/architecture.py"
                        )
                elif n > LIMIT:
                    breaches.append(
                        f"{rel}: {n} lines of non-test code, over {LIMIT}: split it by what "
                        f"its parts do"
                    )
    for rel in sorted(set(OVERSIZE) - seen):
        breaches.append(f"{rel}: listed in OVERSIZE but gone: drop its line")
    return breaches


IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def code_of(text):
    """`text` without its test module, comments and string literals' contents."""
    text = "\n".join(text.split("\n")[: non_test_lines(text)])
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def first_segments(code, start):
    """The first segment of each path that begins at `start` (after a
    `crate::` or `super::`): one name, or each of a `{..}` group's."""
    rest = code[start:]
    m = re.match(IDENT, rest)
    if m:
        return [m.group(0)]
    if not rest.startswith("{"):
        return []
    depth, item, out = 0, "", []
    for ch in rest:
        if ch == "{":
            depth += 1
            if depth == 1:
                continue
        elif ch == "}":
            depth -= 1
            if depth == 0:
                out.append(item)
                break
        if depth == 1 and ch == ",":
            out.append(item)
            item = ""
        elif depth >= 1:
            item += ch
    return [m.group(0) for m in (re.match(r"\s*(" + IDENT + ")", i) for i in out) if m]


def kafka_units(src):
    """Each top-level module of dedup-kafka with its files, and the crate
    root's re-exported names mapped to the module they come from."""
    units = {}
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if name == "lib.rs":
            continue
        if name.endswith(".rs"):
            units[name[:-3]] = [path]
        elif os.path.isdir(path):
            units[name] = [
                os.path.join(folder, f)
                for folder, _, files in os.walk(path)
                for f in files
                if f.endswith(".rs")
            ]
    exported = {}
    with open(os.path.join(src, "lib.rs"), encoding="utf-8") as f:
        lib = code_of(f.read())
    for m in re.finditer(r"pub use (" + IDENT + r")::([^;]*);", lib):
        for name in re.findall(IDENT, m.group(2)):
            exported.setdefault(name, m.group(1))
    return units, exported


def module_path(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    return rel[:-1] if rel[-1] == "mod" else rel


def check_kafka_layers():
    src = os.path.join(ROOT, "dedup-kafka", "src")
    units, exported = kafka_units(src)
    edges = {}
    for unit, files in units.items():
        for path in files:
            with open(path, encoding="utf-8") as f:
                code = code_of(f.read())
            here = module_path(src, path)
            targets = []
            for m in re.finditer(r"\bcrate::", code):
                targets += first_segments(code, m.end())
            for m in re.finditer(r"\b((?:super::)+)", code):
                ups = m.group(1).count("super::")
                base = here[: max(len(here) - ups, 0)]
                if base:
                    continue  # within its own top-level module
                targets += first_segments(code, m.end())
            for name in targets:
                target = name if name in units else exported.get(name)
                if target and target != unit:
                    edges.setdefault(unit, {}).setdefault(target, os.path.relpath(path, ROOT))
    breaches = []
    shared = set(units) - RUNTIMES - {RELAY, PIPELINE}
    for unit, targets in sorted(edges.items()):
        for target, where in sorted(targets.items()):
            why = None
            if unit in RUNTIMES and target in RUNTIMES:
                why = "a runtime never imports the other"
            elif unit == PIPELINE and target in RUNTIMES | {RELAY}:
                why = "pipeline/ is below the runtimes"
            elif unit in shared and target in RUNTIMES | {RELAY}:
                why = "the shared root is below the runtimes"
            if why:
                breaches.append(f"dedup-kafka: {unit} imports {target} ({where}): {why}")
    for cycle in cycles(edges):
        breaches.append("dedup-kafka: modules that import each other in a cycle: " + ", ".join(cycle))
    return breaches


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    nodes = set(edges) | {w for t in edges.values() for w in t}
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def library_files():
    """Every source file of the library crates, relative to the root."""
    for crate in LIBRARY_CRATES:
        for dirpath, _, names in os.walk(os.path.join(ROOT, crate, "src")):
            for name in sorted(names):
                if name.endswith(".rs"):
                    yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def check_map():
    with open(os.path.join(ROOT, "ARCHITECTURE.md"), encoding="utf-8") as f:
        text = f.read()
    files = list(library_files())
    # Test and bench files may be named too.
    everything = files + [
        os.path.relpath(os.path.join(d, n), ROOT)
        for top in ("tests", "bench", "examples")
        for d, _, names in os.walk(os.path.join(ROOT, top))
        for n in names
        if n.endswith(".rs")
    ]
    breaches = []
    named = set(re.findall(r"[\w./-]*\w\.rs\b", text))
    for name in sorted(named):
        if not any(("/" + path).endswith("/" + name) for path in everything):
            breaches.append(f"ARCHITECTURE.md names {name}, which no library crate has")
    words = set(re.findall(r"[\w.-]+/?", text))
    for path in files:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            if non_test_lines(f.read()) <= MAPPED:
                continue
        base = os.path.basename(path)
        folder = os.path.basename(os.path.dirname(path)) + "/"
        shown = folder if base in ("mod.rs", "lib.rs", "main.rs") else base
        if base in ("lib.rs", "main.rs"):
            continue  # the crate itself, on the crate map
        if shown not in words and base not in named:
            breaches.append(f"{path}: over {MAPPED} lines and not on ARCHITECTURE.md's map")
    return breaches


def main():
    breaches = check_sizes() + check_kafka_layers() + check_map()
    for breach in breaches:
        print(f"architecture: {breach}", file=sys.stderr)
    if breaches:
        return 1
    listed = f" ({len(OVERSIZE)} listed over it)" if OVERSIZE else ""
    print(f"architecture: every library file within {LIMIT} lines of non-test code{listed}; "
          "dedup-kafka's layers without cycles; ARCHITECTURE.md maps the large files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
