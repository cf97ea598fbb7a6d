#!/usr/bin/env python
"""Where one thread's time went, from a py-spy recording (``py-spy record --threads --idle -f raw``).

py-spy samples every thread of a process without touching its code; its raw output is one line per
distinct stack, ``thread (tid): name;frame;frame;... count``. This sums the samples of the threads
whose name contains ``--thread`` (default: the runtime's loop thread), leaves out the samples where
the thread sat waiting (a leaf frame named ``wait``, ``sem_clockwait``, ``select``, ``poll``...), and
prints the functions by inclusive samples, below ``--root`` if given (the first frame whose name
starts with it), with the leaf functions after them. Pure Python; any machine.

    py-spy record --threads --idle -r 200 -f raw -o /tmp/spy.txt -- python scripts/serve_e2e.py \\
        examples/mix6.yaml --tiny --device cpu --scale 0.2 --duration 8 --http-workers 2 --clients 1
    python scripts/spy_summary.py /tmp/spy.txt --root InferenceService._settle --out /tmp/settle.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import Counter
from pathlib import Path

_LINE_NO = re.compile(r":\d+\)")
#: a leaf frame where the thread waits: its function's own name (after the class), e.g.
#: ``SemaphoreWaker.wait``, ``Condition.wait``, ``select``, ``Event.wait`` (not ``_LoopIntake.poll``: busy)
_WAITING = re.compile(r"^(?:[\w<>.]*\.)?(wait|_wait|wait_for|sem_clockwait|select|epoll_wait|sleep)\b")


def parse(lines) -> list[tuple[str, list[str], int]]:
    """``(thread, frames without line numbers, samples)`` per line of py-spy's raw output."""
    out = []
    for line in lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [_LINE_NO.sub(")", f) for f in stack.split(";")]
        out.append((frames[0], frames[1:], int(n)))
    return out


def summarize(stacks, thread: str, root: str | None = None) -> dict:
    """The samples of threads named like ``thread``: total, waiting, busy, and (below ``root``, when
    given) inclusive and leaf counts per function."""
    total = waiting = busy = 0
    inclusive, leaf = Counter(), Counter()
    for name, frames, n in stacks:
        if thread not in name:
            continue
        total += n
        if frames and _WAITING.match(frames[-1]):
            waiting += n
            continue
        if root is not None:
            at = next((i for i, f in enumerate(frames) if f.startswith(root)), None)
            if at is None:
                continue
            frames = frames[at:]
        busy += n
        for f in dict.fromkeys(frames):  # each function once per sample, however deep it recurses
            inclusive[f] += n
        if frames:
            leaf[frames[-1]] += n
    return {"thread": thread, "root": root, "samples": total, "waiting": waiting, "busy": busy,
            "inclusive": inclusive.most_common(), "leaf": leaf.most_common()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recording", help="py-spy record ... -f raw output (or that gzipped: FILE.gz)")
    ap.add_argument("--thread", default="gpuloom-runtime", help="part of the thread's name (default gpuloom-runtime)")
    ap.add_argument("--root", default=None, help="count only samples below the first frame starting with this")
    ap.add_argument("--top", type=int, default=30, help="functions to print (default 30)")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    a = ap.parse_args(argv)
    try:
        path = Path(a.recording)
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        stacks = parse(text.splitlines())
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = summarize(stacks, a.thread, a.root)
    if not s["samples"]:
        print(f"error: no samples of a thread named like {a.thread!r} in {a.recording}", file=sys.stderr)
        return 2
    below = f" below {a.root}" if a.root else ""
    print(f"{a.thread}: {s['samples']} samples, {s['waiting']} waiting, {s['busy']} busy{below}")
    for f, n in s["inclusive"][:a.top]:
        print(f"{n:7d} {n / max(1, s['busy']):6.1%}  {f}")
    print("leaf functions:")
    for f, n in s["leaf"][:max(5, a.top // 3)]:
        print(f"{n:7d} {n / max(1, s['busy']):6.1%}  {f}")
    if a.out:
        Path(a.out).write_text(json.dumps(s, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
