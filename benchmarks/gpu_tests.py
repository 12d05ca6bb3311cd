"""Record a run of the test suite on a GPU machine: pytest's counts from its log, one row in
benchmarks/results/gpu_tests.csv (GPU, torch, CUDA, commit, date, passed/failed/skipped/errors, duration),
so that the commit and GPU the CUDA suite last passed on is a row anyone can find (benchmarks/report.py shows
the latest in RESULTS.md). scripts/check_gpu.sh runs it after the suite:

    python -m pytest -q -rs tests 2>&1 | tee tests.log
    python benchmarks/gpu_tests.py tests.log --seconds 812 [--target tests] [--allow-skip REGEX]
                                  [--results DIR | --no-results]

The counts come from pytest's final summary line ("2939 passed, 1 skipped, 3 warnings in 812.34s"), the
skipped tests and their reasons from the -rs lines ("SKIPPED [3] tests/test_x.py:12: reason"), each line
counting the tests it groups. Exit status: 0 when nothing failed or errored and every skipped test's reason
matches --allow-skip (default: the multi-GPU tests' "needs 2 CUDA devices"); 1 otherwise; 2 when the log
has no summary line (pytest did not finish), which is recorded too.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

COUNTS = ("passed", "failed", "skipped", "errors", "xfailed", "xpassed", "deselected", "warnings")
ALLOWED_SKIP = r"needs 2 CUDA devices"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SUMMARY = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+|no tests ran)\s+in\s+([0-9.]+)s\b")
_SKIPPED = re.compile(r"^SKIPPED\s+\[(\d+)\]\s+(.*)$")


def parse_summary(text):
    """pytest's counts from the last summary line of `text`: a dict with every name of COUNTS (0 where the
    line does not name it) and "seconds" (pytest's own timing), or None when there is no summary line."""
    found = None
    for line in text.splitlines():
        m = _SUMMARY.match(_ANSI.sub("", line).strip())
        if m:
            found = m
    if found is None:
        return None
    counts = dict.fromkeys(COUNTS, 0)
    if found.group(1) != "no tests ran":
        for part in found.group(1).split(", "):
            n, name = part.split(" ", 1)
            name = {"error": "errors", "warning": "warnings"}.get(name, name)
            if name in counts:  # others (a plugin's "rerun", say) are not recorded
                counts[name] += int(n)
    counts["seconds"] = float(found.group(2))
    return counts


def parse_skips(text):
    """[(count, "file:line: reason")] from pytest's -rs lines."""
    out = []
    for line in text.splitlines():
        m = _SKIPPED.match(_ANSI.sub("", line).strip())
        if m:
            out.append((int(m.group(1)), m.group(2)))
    return out


def verdict(counts, skips, allowed=ALLOWED_SKIP):
    """(exit status, one line saying why) for a run's counts and skips."""
    if counts is None:
        return 2, "no pytest summary line in the log: the run did not finish"
    unexpected = sum(n for n, reason in skips if not re.search(allowed, reason))
    allowed_n = counts["skipped"] - unexpected
    line = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, {counts['skipped']} "
            f"skipped ({allowed_n} allowed)")
    if counts["failed"] or counts["errors"]:
        return 1, "FAILED: " + line
    if unexpected or sum(n for n, _ in skips) != counts["skipped"]:
        return 1, f"FAILED: {line}: skipped tests on a GPU machine (see the SKIPPED lines)"
    return 0, "OK: " + line


def row(counts, target, seconds, status):
    """The results row of one run."""
    c = counts or {}
    return {"benchmark": "gpu_tests", "config": target, "variant": "pytest", "kind": "lsmini",
            "result": {0: "passed", 1: "failed", 2: "unfinished"}[status],
            **{k: c.get(k) for k in ("passed", "failed", "skipped", "errors")},
            "duration_s": round(seconds) if seconds is not None else None}


def gpu_name():
    import torch

    if not torch.cuda.is_available():
        return "none"
    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    return name if n == 1 else f"{n} × {name}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="the output of `python -m pytest -q -rs ...`")
    ap.add_argument("--seconds", type=float, help="wall time of the pytest command (default: pytest's own)")
    ap.add_argument("--target", default="tests", help="what pytest ran (default: tests)")
    ap.add_argument("--allow-skip", default=ALLOWED_SKIP, metavar="REGEX",
                    help=f"skip reasons that do not fail the run (default: {ALLOWED_SKIP!r})")
    common.add_results_arguments(ap)
    args = ap.parse_args(argv)
    with open(args.log, errors="replace") as f:
        text = f.read()
    counts, skips = parse_summary(text), parse_skips(text)
    status, line = verdict(counts, skips, args.allow_skip)
    seconds = args.seconds if args.seconds is not None else (counts or {}).get("seconds")
    print(f"tests: {line}" + (f" in {seconds:.0f} s" if seconds is not None else ""))
    common.append_results(args.results, "gpu_tests", common.environment(gpu=gpu_name()),
                          [row(counts, args.target, seconds, status)])
    return status


if __name__ == "__main__":
    sys.exit(main())
