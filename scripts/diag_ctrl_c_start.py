#!/usr/bin/env python
"""Ctrl-C while ``gpuloom serve`` starts: what each SIGINT at a given time after launch ends in (CPU).

Why: a KeyboardInterrupt there aborted the process in torch's C++ callbacks or at the interpreter's
teardown under the builder thread, or was swallowed by a gc callback and the server served anyway
(sixty-fifth session, ``reports/serving.md``). Each try launches ``python -m gpuloom serve REPOSITORY
--device cpu`` from ``--tree`` (another checkout times the code before a change), sends SIGINT after
``t`` seconds, then SIGTERM 12 s later, and records the exit status, whether it served, and the last line.

    python scripts/diag_ctrl_c_start.py --at 0.3,0.5,0.8,1,1.2,1.5,2,3,4,5,6,8 --out /tmp/ctrl_c.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_try(tree: str, repository: str, at_s: float) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    repository = str(Path(repository).resolve())
    p = subprocess.Popen([sys.executable, "-m", "gpuloom", "serve", repository, "--device", "cpu", "--http-port", "0",
                          "--no-grpc"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=tree)  # (python -m puts the working directory first on sys.path)
    time.sleep(at_s)
    p.send_signal(signal.SIGINT)
    try:
        err = p.communicate(timeout=12)[1]
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            err = p.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            p.kill()
            err = p.communicate()[1]
    lines = [ln for ln in err.splitlines() if ln.strip() and "torch" not in ln]
    return {"at_s": at_s, "rc": p.returncode, "served": any("gpuloom serving" in ln for ln in lines),
            "traceback": "Traceback" in err, "aborted": p.returncode == -signal.SIGABRT,
            "last": lines[-1][:300] if lines else ""}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--at", default="0.5,1,2,3,4,5,6,8", help="seconds after launch, comma-separated")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose gpuloom runs (default this one)")
    ap.add_argument("--repository", default=str(ROOT / "examples" / "repository"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for t in (float(x) for x in a.at.split(",")):
        r = one_try(a.tree, a.repository, t)
        rows.append(r)
        print(f"SIGINT at {t:g} s: rc {r['rc']}{' served' if r['served'] else ''}"
              f"{' traceback' if r['traceback'] else ''} | {r['last']}", flush=True)
    clean = sum(r["rc"] == 130 and not r["served"] and not r["traceback"] for r in rows)
    print(f"{clean} of {len(rows)} ended with 130 before serving, without a traceback")
    if a.out:
        Path(a.out).write_text(json.dumps({"tree": a.tree, "tries": rows}, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
