#!/usr/bin/env python3
"""Runs the workspace's test binaries side by side, built by the caller.

`cargo test --workspace` runs one test binary after another, and most of
this workspace's test time goes to waiting on brokers, rebalances and
restarts, not to the CPU. Every test makes its own topics, groups,
databases and ports, so binaries can run at once: this runs them in
`--lanes` lanes, the slowest first (by the times of the previous run, kept
in the log directory, or the `--first` names on a fresh machine). It runs
each executable `cargo test --workspace --no-run` lists directly, in its
package's directory with the CARGO_* variables cargo would give it, so no
cargo runs beside another (one would rebuild what the other is linking);
the doc tests are `cargo test --doc`, a job of their own.

Each job's output goes to `<log-dir>/<name>.log`; a line is printed as
each ends, the failures' output at the end, then a table of every job's
time and the closing `all tests: N passed, M failed` line. A job that
outlives `--limit` seconds is stopped (with every process it started) and
counted as failed, so a stalled test names itself instead of running the
whole command over its time. Exits non-zero if any job failed.

    python3 scripts/tests.py --lanes 4            # everything
    python3 scripts/tests.py kafka "doc tests"    # some jobs, by test or job name
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

RESULT = re.compile(r"^test result: \w+\. (\d+) passed; (\d+) failed")


def cargo():
    return os.environ.get("CARGO") or shutil.which("cargo") or "cargo"


def packages():
    """The workspace's packages by id: name, version, manifest path."""
    out = subprocess.run(
        [cargo(), "metadata", "--no-deps", "--format-version", "1", "--locked"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {package["id"]: package for package in json.loads(out)["packages"]}


def build():
    """Builds everything the tests run: the examples and the CLI with its
    crash points, which the end-to-end tests start as processes, with the
    features of the whole workspace (so no dependency is built twice), and
    the test executables. Returns those: (package id, target name, target
    kind, path)."""
    subprocess.run(
        [cargo(), "build", "--workspace", "--locked", "--bins", "--examples",
         "--features", "dedup-cli/failpoints"],
        check=True,
    )
    listed = subprocess.run(
        [cargo(), "test", "--workspace", "--locked", "--no-run",
         "--message-format=json-render-diagnostics"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    found = []
    for line in listed.stdout.splitlines():
        message = json.loads(line)
        if message.get("reason") != "compiler-artifact" or not message.get("executable"):
            continue
        if not message["profile"]["test"]:
            continue
        target = message["target"]
        found.append((message["package_id"], target["name"], target["kind"][0], message["executable"]))
    return found


def rust_libraries():
    """The toolchain's library directory: proc-macro crates' test binaries
    link the standard library dynamically."""
    rustc = os.environ.get("RUSTC") or "rustc"
    out = subprocess.run([rustc, "--print", "target-libdir"], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def environment(package, target_dir, toolchain_libraries):
    """What `cargo test` gives a test binary it runs: the package's
    CARGO_* variables (trybuild reads them at run time), and its
    libraries' directories."""
    env = dict(os.environ)
    # The examples and the CLI are built (build()): a test need not build
    # them again (common::example, common::cli).
    env["DEDUP_TESTS_PREBUILT"] = "1"
    version = package["version"]
    core = version.split("+")[0].split("-")[0].split(".")
    env.update(
        CARGO=cargo(),
        CARGO_MANIFEST_DIR=os.path.dirname(package["manifest_path"]),
        CARGO_MANIFEST_PATH=package["manifest_path"],
        CARGO_PKG_NAME=package["name"],
        CARGO_PKG_VERSION=version,
        CARGO_PKG_VERSION_MAJOR=core[0],
        CARGO_PKG_VERSION_MINOR=core[1],
        CARGO_PKG_VERSION_PATCH=core[2],
        CARGO_PKG_VERSION_PRE=version.partition("-")[2],
        CARGO_PKG_DESCRIPTION=package.get("description") or "",
        CARGO_PKG_REPOSITORY=package.get("repository") or "",
        CARGO_PKG_LICENSE=package.get("license") or "",
        CARGO_PKG_AUTHORS=":".join(package.get("authors") or []),
        CARGO_PKG_RUST_VERSION=package.get("rust_version") or "",
    )
    libraries = [os.path.join(target_dir, "deps"), target_dir, toolchain_libraries]
    if env.get("LD_LIBRARY_PATH"):
        libraries.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libraries)
    return env


class Job:
    """One test executable (or the doc tests) and how its run went."""

    def __init__(self, name, command, log_dir, cwd=None, env=None, target=None):
        self.name = name
        self.target = target
        self.command = command
        self.cwd = cwd
        self.env = env
        self.log_path = os.path.join(log_dir, re.sub(r"[^\w.-]+", "_", name) + ".log")
        self.process = None
        self.log = None
        self.started = None
        self.seconds = None
        self.passed = 0
        self.failed = 0
        self.ok = False
        self.timed_out = False

    def matches(self, names):
        return self.name in names or (self.target is not None and self.target in names)

    def start(self):
        self.log = open(self.log_path, "w")
        self.started = time.monotonic()
        # Its own process group, so a stalled job is stopped with every
        # process it started (members, examples, brokers of its own).
        self.process = subprocess.Popen(
            self.command,
            cwd=self.cwd,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self):
        self.timed_out = True
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def finish(self, code):
        self.seconds = time.monotonic() - self.started
        self.log.close()
        with open(self.log_path, errors="replace") as log:
            for line in log:
                m = RESULT.match(line)
                if m:
                    self.passed += int(m.group(1))
                    self.failed += int(m.group(2))
        self.ok = code == 0 and not self.timed_out

    def summary(self):
        state = "ok" if self.ok else ("STALLED" if self.timed_out else "FAILED")
        return (
            f"{self.name:<34} {state:<7} {self.passed:>4} passed {self.failed:>3} failed"
            f" {self.seconds:>7.1f} s"
        )


def failure_output(job, max_lines=3000):
    """The failed job's report: from cargo's `failures:` on, else its tail."""
    with open(job.log_path, errors="replace") as log:
        lines = log.readlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("failures:")), None)
    if start is None or job.timed_out:
        start = max(0, len(lines) - 300)
    return "".join(lines[start : start + max_lines])


def run(jobs, lanes, limit):
    """Runs `jobs` (in order) in `lanes` at once; returns them finished."""
    waiting = list(jobs)
    running = {}
    while waiting or running:
        while waiting and len(running) < lanes:
            job = waiting.pop(0)
            job.start()
            running[job.process.pid] = job
        time.sleep(0.5)
        for pid, job in list(running.items()):
            if job.process.poll() is None:
                if time.monotonic() - job.started > limit:
                    job.stop()
                continue
            job.finish(job.process.returncode)
            del running[pid]
            print(f"tests ({lanes} lanes): {job.summary()}", flush=True)
    return jobs


def jobs_of(log_dir, executables):
    """A job per test executable, named `<package> <target>` (an
    integration test) or `<package> (lib)` / `(bin <name>)` (unit tests),
    and one for the doc tests."""
    by_id = packages()
    toolchain_libraries = rust_libraries()
    jobs = [Job("doc tests", [cargo(), "test", "--workspace", "--locked", "--doc"], log_dir)]
    for package_id, target, kind, executable in executables:
        package = by_id[package_id]
        name = f"{package['name']} {target}" if kind == "test" else f"{package['name']} ({kind} {target})"
        target_dir = os.path.dirname(os.path.dirname(executable))
        jobs.append(
            Job(
                name,
                [executable],
                log_dir,
                cwd=os.path.dirname(package["manifest_path"]),
                env=environment(package, target_dir, toolchain_libraries),
                target=target if kind == "test" else None,
            )
        )
    return jobs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--first", default="", help="comma-separated tests to start first when no times are kept")
    parser.add_argument("--limit", type=int, default=1200, help="seconds a job may take")
    parser.add_argument("--log-dir", default="target/test-logs")
    parser.add_argument("--no-run", action="store_true", help="only build what the tests run")
    parser.add_argument("--show-output", action="store_true", help="keep passing tests' output in the logs too")
    parser.add_argument("only", nargs="*", help="run only these jobs (a test target's name, or a job's)")
    args = parser.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    times_path = os.path.join(args.log_dir, "times.json")

    executables = build()
    if not any(kind == "test" for _, _, kind, _ in executables):
        sys.exit("tests: cargo listed no integration test to run")
    if args.no_run:
        return 0
    jobs = jobs_of(args.log_dir, executables)
    if args.show_output:
        for job in jobs:
            if job.name != "doc tests":
                job.command.append("--show-output")
    if args.only:
        jobs = [job for job in jobs if job.matches(args.only)]

    try:
        with open(times_path) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        previous = {}
    first = [n for n in args.first.split(",") if n]
    if all(job.name in previous for job in jobs):
        jobs.sort(key=lambda job: -previous[job.name])
    else:
        rank = {name: i for i, name in enumerate(first)}
        jobs.sort(key=lambda job: min([rank[n] for n in (job.name, job.target) if n in rank] or [len(rank)]))

    began = time.monotonic()
    # Interrupted (Ctrl-C, or CI cancelling with SIGTERM), the jobs go too:
    # each runs in a process group of its own, which the terminal's and
    # CI's signals do not reach.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        done = run(jobs, args.lanes, args.limit)
    finally:
        for job in jobs:
            if job.process is not None and job.process.poll() is None:
                job.stop()
    wall = time.monotonic() - began

    kept = {**previous, **{job.name: round(job.seconds, 1) for job in done}}
    with open(times_path, "w") as f:
        json.dump(kept, f, indent=1, sort_keys=True)

    failed = [job for job in done if not job.ok]
    for job in failed:
        print(f"\n==== {job.name}: {' '.join(job.command)} (full log: {job.log_path})")
        print(failure_output(job), end="")
    print("\ntests: each job's time (slowest first)")
    for job in sorted(done, key=lambda job: -job.seconds):
        print(f"  {job.summary()}")
    serial = sum(job.seconds for job in done)
    print(f"tests: {wall:.0f} s of wall time for {serial:.0f} s of jobs in {args.lanes} lanes")
    passed = sum(job.passed for job in done)
    failures = sum(job.failed for job in done) + sum(1 for job in failed if job.failed == 0)
    print(f"all tests: {passed} passed, {failures} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
