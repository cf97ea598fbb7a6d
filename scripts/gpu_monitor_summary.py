"""Summarize what `nvidia-smi -l` saw during a device call: SM clocks, power, temperature and the
clock-event (throttle) reasons while the GPU was busy.

Why: on the H200 one lent machine ran every policy slower than another (runs 57-58 against 53-54
and 59-60), and the one `nvidia-smi` line at the start of a call (idle clocks) could not say whether
the GPU was held back. `scripts/gpu_runtime_session.sh` samples every second during the call and
appends this summary to `logs/gpu.txt`.

    python3 scripts/gpu_monitor_summary.py /tmp/gpu_monitor.csv

Input: `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,
utilization.gpu,clocks_event_reasons.active --format=csv,noheader` lines (units as nvidia-smi
prints them; the reasons field may be missing or "[N/A]").
"""

from __future__ import annotations

import statistics
import sys

BUSY_UTILIZATION = 50.0  # %: samples at or above this count as the GPU at work


def _number(field: str) -> float | None:
    """``"1980 MHz"`` -> 1980.0; ``"[N/A]"`` or junk -> None."""
    head = field.strip().split(" ")[0] if field.strip() else ""
    try:
        return float(head)
    except ValueError:
        return None


def parse(lines) -> list[dict]:
    """One dict per sample line (timestamp, sm_mhz, mem_mhz, power_w, temp_c, util, reasons)."""
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6 or _number(parts[1]) is None:  # an error message, or a header
            continue
        rows.append({"timestamp": parts[0], "sm_mhz": _number(parts[1]), "mem_mhz": _number(parts[2]),
                     "power_w": _number(parts[3]), "temp_c": _number(parts[4]), "util": _number(parts[5]),
                     "reasons": parts[6] if len(parts) > 6 else ""})
    return rows


def _span(values) -> str:
    v = sorted(x for x in values if x is not None)
    if not v:
        return "n/a"
    return f"{v[0]:.0f} / {statistics.median(v):.0f} / {v[-1]:.0f}"


def summarize(rows: list[dict]) -> str:
    """A few lines: samples, and over the busy ones the SM clock, power and temperature (min /
    median / max) and each non-zero clock-event reason mask with its count."""
    if not rows:
        return "gpu monitor: no samples (nvidia-smi could not be sampled)"
    busy = [r for r in rows if (r["util"] or 0) >= BUSY_UTILIZATION]
    out = [f"gpu monitor: {len(rows)} samples, {len(busy)} at >= {BUSY_UTILIZATION:.0f}% utilization"]
    if busy:
        out.append(f"  busy: SM clock MHz min/median/max {_span(r['sm_mhz'] for r in busy)}; "
                   f"power W {_span(r['power_w'] for r in busy)}; temperature C {_span(r['temp_c'] for r in busy)}")
        reasons: dict[str, int] = {}
        for r in busy:
            mask = r["reasons"]
            if mask and mask not in ("[N/A]", "N/A") and (_hex(mask) or 0) != 0:
                reasons[mask] = reasons.get(mask, 0) + 1
        out.append("  clock-event reasons while busy: "
                   + (", ".join(f"{m} x{n}" for m, n in sorted(reasons.items())) if reasons else "none"))
    return "\n".join(out)


def _hex(mask: str) -> int | None:
    try:
        return int(mask, 16)
    except ValueError:
        return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[0])
        print("usage: gpu_monitor_summary.py MONITOR_CSV")
        return 2
    try:
        with open(argv[0], encoding="utf-8", errors="replace") as f:
            print(summarize(parse(f)))
    except OSError as e:
        print(f"gpu monitor: could not read {argv[0]}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
