"""Workloads: which models are served, at what SLO and weight, and when their requests arrive.

A workload is a small YAML (or JSON) file::

    duration_s: 60          # seconds of arrivals to generate
    seed: 0                 # every arrival process is deterministic for this seed
    gpu: h200               # which shipped profiles to plan against
    models:
      - name: resnet50      # a profile model name or a full profile key
        slo_ms: 25          # end-to-end latency target, ms
        weight: 1.0         # priority when the GPU is oversubscribed (weighted max-min)
        arrival: {kind: poisson, rate: 400}          # requests/s
      - name: bert_base
        slo_ms: 80
        rate: 50            # shorthand for a Poisson arrival at 50 requests/s
      - name: vgg16
        slo_ms: 100
        arrival: {kind: onoff, rate: 300, on_s: 2, off_s: 6}   # bursts at 300 req/s
      - name: mobilenet_v2
        slo_ms: 15
        arrival: {kind: piecewise, segments: [[0, 100], [20, 600], [40, 100]]}  # (start_s, req/s)
      - name: efficientnet_b0
        slo_ms: 20
        arrival: {kind: trace, trace: ts.txt}   # one timestamp (s) per line, relative to this file
        deadline_factors: [0.5, 1, 1, 4]        # optional: clients' own timeouts, each request due at
                                                # one of these x slo_ms, drawn uniformly (default: 1)

Arrival processes (all rates in requests/s, times in seconds):

* ``poisson``: exponential inter-arrival times at ``rate``.
* ``onoff``: Poisson at ``rate`` for ``on_s`` seconds, then silent for ``off_s`` seconds, repeating;
  the first period starts "on" at t = 0.
* ``piecewise``: Poisson whose rate is ``segments[i][1]`` from ``segments[i][0]`` until the next
  segment starts (the first segment must start at 0).
* ``trace``: recorded timestamps, divided by ``scale`` (``scale`` = 2 plays the trace twice as fast)
  and repeated end to end until the duration is covered.

Plain Python (no torch): the planner, the simulator and the command line read workloads anywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from gpuloom.runtime.model_config import MAX_SLO_MS

if TYPE_CHECKING:  # only for type hints: the profile store is imported lazily by validate()
    from gpuloom.plan import Demand
    from gpuloom.profile.store import ProfileStore

SCHEMA = "gpuloom.workload/1"
ARRIVAL_KINDS = ("poisson", "onoff", "piecewise", "trace")


class WorkloadError(ValueError):
    """A workload file or object is malformed or cannot be served by the given profiles."""


@dataclass(frozen=True)
class Arrival:
    """One model's arrival process. Rates are requests/s, times seconds."""

    kind: str  # "poisson" | "onoff" | "piecewise" | "trace"
    rate: float = 0.0  # requests/s (poisson; onoff: the rate while on)
    on_s: float = 0.0  # onoff: length of a burst, s
    off_s: float = 0.0  # onoff: silence between bursts, s
    segments: tuple[tuple[float, float], ...] = ()  # piecewise: (start_s, requests/s), ascending starts from 0
    trace: str | None = None  # trace: path of a file of timestamps (s), one per line
    scale: float = 1.0  # trace: playback speed-up (rate multiplier)

    def __post_init__(self) -> None:
        segs = tuple((float(s), float(r)) for s, r in self.segments)
        object.__setattr__(self, "segments", segs)
        k = self.kind
        if k not in ARRIVAL_KINDS:
            raise WorkloadError(f"arrival kind must be one of {list(ARRIVAL_KINDS)}, found {k!r}")
        for name in ("rate", "on_s", "off_s", "scale"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise WorkloadError(f"{k} arrival: {name} must be a finite number, found {v!r}")
        if k in ("poisson", "onoff") and not self.rate > 0:
            raise WorkloadError(f"{k} arrival: rate must be > 0 requests/s, found {self.rate}")
        if k == "onoff" and not (self.on_s > 0 and self.off_s >= 0):
            raise WorkloadError(f"onoff arrival: need on_s > 0 and off_s >= 0 seconds, found on_s={self.on_s}, off_s={self.off_s}")
        if k == "piecewise":
            if not segs:
                raise WorkloadError("piecewise arrival: needs segments [[start_s, rate], ...], found none")
            starts = [s for s, _ in segs]
            if starts[0] != 0.0 or any(b <= a for a, b in zip(starts, starts[1:])):
                raise WorkloadError(f"piecewise arrival: segment starts must ascend strictly from 0, found {starts}")
            if any(r < 0 or not math.isfinite(r) for _, r in segs) or not any(r > 0 for _, r in segs):
                raise WorkloadError(f"piecewise arrival: rates must be >= 0 with at least one > 0, found {[r for _, r in segs]}")
        if k == "trace":
            if not self.trace:
                raise WorkloadError("trace arrival: needs 'trace', the path of a timestamp file")
            if not self.scale > 0:
                raise WorkloadError(f"trace arrival: scale must be > 0, found {self.scale}")

    # -- rates ------------------------------------------------------------------------------
    def rate_at(self, t: float) -> float:
        """Instantaneous rate (requests/s) at time ``t`` s; a trace reports its mean rate."""
        if self.kind == "poisson":
            return self.rate
        if self.kind == "onoff":
            period = self.on_s + self.off_s
            return self.rate if (t % period) < self.on_s else 0.0
        if self.kind == "piecewise":
            r = self.segments[0][1]
            for s, rr in self.segments:
                if s <= t:
                    r = rr
            return r
        ts = _read_trace(self.trace)
        span = _trace_period(ts) / self.scale
        return len(ts) / span if span > 0 else 0.0

    def mean_rate(self, duration_s: float) -> float:
        """Requests/s averaged over ``[0, duration_s)`` (exact integral; a trace is counted)."""
        if duration_s <= 0:
            raise WorkloadError(f"duration must be > 0 s, found {duration_s}")
        if self.kind == "poisson":
            return self.rate
        if self.kind == "onoff":
            period = self.on_s + self.off_s
            full, rest = divmod(duration_s, period)
            on_time = full * self.on_s + min(rest, self.on_s)
            return self.rate * on_time / duration_s
        if self.kind == "piecewise":
            total = 0.0
            bounds = [s for s, _ in self.segments] + [math.inf]
            for (start, r), end in zip(self.segments, bounds[1:]):
                lo, hi = min(start, duration_s), min(end, duration_s)
                total += r * (hi - lo)
            return total / duration_s
        return len(self.times(duration_s, random.Random(0))) / duration_s

    def peak_rate(self, duration_s: float) -> float:
        """Highest instantaneous rate within the duration, requests/s (a trace: its mean)."""
        if self.kind == "piecewise":
            return max(r for s, r in self.segments if s < duration_s)
        if self.kind == "trace":
            return self.mean_rate(duration_s)
        return self.rate

    def scaled(self, factor: float) -> "Arrival":
        """The same process with every rate multiplied by ``factor`` (a trace plays faster)."""
        if not factor > 0:
            raise WorkloadError(f"rate scale factor must be > 0, found {factor}")
        if self.kind == "piecewise":
            return dataclasses.replace(self, segments=tuple((s, r * factor) for s, r in self.segments))
        if self.kind == "trace":
            return dataclasses.replace(self, scale=self.scale * factor)
        return dataclasses.replace(self, rate=self.rate * factor)

    # -- generation -------------------------------------------------------------------------
    def times(self, duration_s: float, rng: random.Random) -> list[float]:
        """Arrival timestamps (s), ascending, within ``[0, duration_s)``."""
        if self.kind == "poisson":
            return _poisson(rng, self.rate, 0.0, duration_s)
        if self.kind == "onoff":
            out: list[float] = []
            period = self.on_s + self.off_s
            start = 0.0
            while start < duration_s:
                out += _poisson(rng, self.rate, start, min(start + self.on_s, duration_s))
                start += period
            return out
        if self.kind == "piecewise":
            out = []
            bounds = [s for s, _ in self.segments] + [math.inf]
            for (start, r), end in zip(self.segments, bounds[1:]):
                if start >= duration_s:
                    break
                if r > 0:
                    out += _poisson(rng, r, start, min(end, duration_s))
            return out
        ts = _read_trace(self.trace)
        if not ts:
            return []
        period = _trace_period(ts) / self.scale
        base = [t / self.scale for t in ts]
        out = []
        offset = 0.0
        while offset < duration_s:
            for t in base:
                if t + offset >= duration_s:
                    break
                out.append(t + offset)
            offset += period
        return out

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind}
        if self.kind in ("poisson", "onoff"):
            d["rate"] = self.rate
        if self.kind == "onoff":
            d.update(on_s=self.on_s, off_s=self.off_s)
        if self.kind == "piecewise":
            d["segments"] = [list(s) for s in self.segments]
        if self.kind == "trace":
            d["trace"] = self.trace
            if self.scale != 1.0:
                d["scale"] = self.scale
        return d


@dataclass(frozen=True)
class ModelSpec:
    """One served model: its profile, its latency target and its share when the GPU is short."""

    name: str  # profile model name ("resnet50") or full key ("resnet50|3x224x224|float32")
    slo_ms: float  # end-to-end latency target of one request, ms
    weight: float = 1.0  # weighted max-min share under overload (2.0 = twice the served fraction)
    arrival: Arrival | None = None  # requests of this model (required; the default only keeps field order)
    # each request due at one of these x slo_ms, drawn uniformly per request (clients with their own
    # timeouts); empty: every request due at slo_ms
    deadline_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise WorkloadError(f"model name must be a non-empty string, found {self.name!r}")
        if not isinstance(self.slo_ms, (int, float)) or not self.slo_ms > 0 or not math.isfinite(self.slo_ms):
            raise WorkloadError(f"model {self.name!r}: slo_ms must be a positive number of ms, found {self.slo_ms!r}")
        if self.slo_ms > MAX_SLO_MS:  # (the planner's cycle grows with the longest SLO)
            raise WorkloadError(f"model {self.name!r}: slo_ms must be at most {MAX_SLO_MS:.0f} (an hour), found {self.slo_ms!r}")
        if not isinstance(self.weight, (int, float)) or not self.weight > 0 or not math.isfinite(self.weight):
            raise WorkloadError(f"model {self.name!r}: weight must be > 0, found {self.weight!r}")
        if not isinstance(self.arrival, Arrival):
            raise WorkloadError(
                f"model {self.name!r}: arrival must be an Arrival (e.g. Arrival('poisson', rate=100)), "
                f"found {self.arrival!r}"
            )
        factors = self.deadline_factors
        if not isinstance(factors, tuple) or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 and math.isfinite(f) for f in factors):
            raise WorkloadError(f"model {self.name!r}: deadline_factors must be a list of positive numbers "
                                f"(multiples of slo_ms), found {factors!r}")


@dataclass(frozen=True)
class Workload:
    """Models, their arrival processes and how long to run them."""

    models: tuple[ModelSpec, ...]
    duration_s: float  # seconds of arrivals
    seed: int = 0  # arrival_times() is a pure function of the workload, this seed included
    gpu: str = "h200"  # shipped profile set to plan against (gpuloom/profiles/<gpu>/)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        if not self.models:
            raise WorkloadError("a workload needs at least one model")
        names = [m.name for m in self.models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise WorkloadError(f"each model may appear once in a workload; repeated: {dup}")
        if not isinstance(self.duration_s, (int, float)) or not self.duration_s > 0 or not math.isfinite(self.duration_s):
            raise WorkloadError(f"duration_s must be a positive number of seconds, found {self.duration_s!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise WorkloadError(f"seed must be an integer, found {self.seed!r}")

    def spec(self, model: str) -> ModelSpec:
        for m in self.models:
            if m.name == model:
                return m
        raise WorkloadError(f"no model {model!r} in this workload; it has {[m.name for m in self.models]}")

    def mean_rate(self, model: str | ModelSpec) -> float:
        """Requests/s of ``model`` averaged over the duration."""
        spec = model if isinstance(model, ModelSpec) else self.spec(model)
        return spec.arrival.mean_rate(self.duration_s)

    def total_rate(self) -> float:
        return sum(self.mean_rate(m) for m in self.models)

    def scaled(self, factor: float) -> "Workload":
        """The same workload with every arrival rate multiplied by ``factor`` (rate sweeps)."""
        return dataclasses.replace(
            self, models=tuple(dataclasses.replace(m, arrival=m.arrival.scaled(factor)) for m in self.models)
        )

    def demands(self, *, peak: bool = False) -> "list[Demand]":
        """What the planner needs: one ``Demand`` per model at its mean (or peak) rate."""
        from gpuloom.plan import Demand

        return [
            Demand(
                model=m.name,
                rate=m.arrival.peak_rate(self.duration_s) if peak else self.mean_rate(m),
                slo_ms=m.slo_ms,
                weight=m.weight,
            )
            for m in self.models
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "duration_s": self.duration_s,
            "seed": self.seed,
            "gpu": self.gpu,
            "models": [
                {"name": m.name, "slo_ms": m.slo_ms, "weight": m.weight, "arrival": m.arrival.to_dict(),
                 **({"deadline_factors": list(m.deadline_factors)} if m.deadline_factors else {})}
                for m in self.models
            ],
        }


# -- reading --------------------------------------------------------------------------------
def workload_from_dict(data: Mapping[str, Any], base_dir: str | Path | None = None) -> Workload:
    """Build a ``Workload`` from parsed YAML/JSON; trace paths are resolved against ``base_dir``."""
    if not isinstance(data, Mapping):
        raise WorkloadError(f"a workload is a mapping with 'models' and 'duration_s', found {type(data).__name__}")
    schema = data.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise WorkloadError(f"expected workload schema {SCHEMA!r}, found {schema!r}")
    unknown = set(data) - {"schema", "models", "duration_s", "seed", "gpu", "name", "description"}
    if unknown:
        raise WorkloadError(f"unknown workload keys {sorted(unknown)}; expected models, duration_s, seed, gpu")
    if "models" not in data or "duration_s" not in data:
        raise WorkloadError("a workload needs 'models' (a list) and 'duration_s' (seconds)")
    raw_models = data["models"]
    if not isinstance(raw_models, Sequence) or isinstance(raw_models, (str, bytes)):
        raise WorkloadError(f"'models' must be a list of model entries, found {type(raw_models).__name__}")
    models = [_model_from_dict(m, i, base_dir) for i, m in enumerate(raw_models)]
    return Workload(
        models=tuple(models),
        duration_s=_number(data["duration_s"], "duration_s"),
        seed=data.get("seed", 0),
        gpu=str(data.get("gpu", "h200")),
    )


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise WorkloadError(f"{what} must be a number, found {v!r}")
    return float(v)


def _model_from_dict(m: Any, i: int, base_dir: str | Path | None) -> ModelSpec:
    if not isinstance(m, Mapping):
        raise WorkloadError(f"models[{i}] must be a mapping with name, slo_ms and arrival, found {m!r}")
    where = f"models[{i}] ({m.get('name', '?')})"
    unknown = set(m) - {"name", "slo_ms", "weight", "arrival", "rate", "deadline_factors"}
    if unknown:
        raise WorkloadError(f"{where}: unknown keys {sorted(unknown)}; expected name, slo_ms, weight, arrival "
                            f"(or rate), deadline_factors")
    for key in ("name", "slo_ms"):
        if key not in m:
            raise WorkloadError(f"{where}: missing {key!r}")
    if "arrival" in m and "rate" in m:
        raise WorkloadError(f"{where}: give either 'rate' (Poisson) or 'arrival', not both")
    if "arrival" in m:
        a = m["arrival"]
        if not isinstance(a, Mapping) or "kind" not in a:
            raise WorkloadError(f"{where}: arrival must be a mapping with 'kind' (one of {list(ARRIVAL_KINDS)}), found {a!r}")
        allowed = {"kind", "rate", "on_s", "off_s", "segments", "trace", "scale"}
        if set(a) - allowed:
            raise WorkloadError(f"{where}: unknown arrival keys {sorted(set(a) - allowed)}; allowed {sorted(allowed)}")
        kw = {k: v for k, v in a.items() if k != "kind"}
        for k in ("rate", "on_s", "off_s", "scale"):
            if k in kw:
                kw[k] = _number(kw[k], f"{where}: arrival.{k}")
        if "segments" in kw:
            segs = kw["segments"]
            try:
                kw["segments"] = tuple((_number(s, "segment start"), _number(r, "segment rate")) for s, r in segs)
            except (TypeError, ValueError) as e:
                raise WorkloadError(f"{where}: segments must be a list of [start_s, rate] pairs, found {segs!r}") from e
        if kw.get("trace") is not None:
            p = Path(str(kw["trace"]))
            if not p.is_absolute() and base_dir is not None:
                p = Path(base_dir) / p
            kw["trace"] = str(p)
        try:
            arrival = Arrival(kind=a["kind"], **kw)
        except WorkloadError as e:
            raise WorkloadError(f"{where}: {e}") from None
    elif "rate" in m:
        try:
            arrival = Arrival("poisson", rate=_number(m["rate"], f"{where}: rate"))
        except WorkloadError as e:
            raise WorkloadError(f"{where}: {e}") from None
    else:
        raise WorkloadError(f"{where}: needs 'arrival' (or 'rate' for Poisson)")
    factors = m.get("deadline_factors", ())
    if not isinstance(factors, Sequence) or isinstance(factors, (str, bytes)):
        raise WorkloadError(f"{where}: deadline_factors must be a list of multiples of slo_ms, found {factors!r}")
    return ModelSpec(
        name=str(m["name"]),
        slo_ms=_number(m["slo_ms"], f"{where}: slo_ms"),
        weight=_number(m.get("weight", 1.0), f"{where}: weight"),
        arrival=arrival,
        deadline_factors=tuple(_number(f, f"{where}: deadline_factors") for f in factors),
    )


def load_workload(path: str | Path) -> Workload:
    """Read a workload from a ``.yaml``/``.yml`` or ``.json`` file (trace paths relative to it)."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"workload file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}: not valid JSON: {e}") from e
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise WorkloadError(f"{path}: not valid YAML: {e}") from e
    try:
        return workload_from_dict(data, base_dir=path.parent)
    except WorkloadError as e:
        raise WorkloadError(f"{path}: {e}") from None


def validate(workload: Workload, profiles: "ProfileStore") -> None:
    """Check ``workload`` against ``profiles``; raise ``WorkloadError`` naming every problem.

    Checks: each model has a profile; its SLO is at least the profile's fastest possible latency
    (batch 1 on the whole GPU); trace files exist and hold ascending non-negative timestamps;
    every model has a positive mean rate over the duration.
    """
    from gpuloom.profile.store import ProfileError

    problems = []
    for m in workload.models:
        try:
            prof = profiles.get(m.name)
        except ProfileError as e:
            problems.append(f"model {m.name!r}: {e}")
            continue
        fastest = prof.min_latency()
        if m.slo_ms < fastest:
            problems.append(
                f"model {m.name!r}: SLO {m.slo_ms:g} ms is below its fastest possible latency "
                f"{fastest:.3f} ms (batch {prof.batches[0]} on all {prof.sms[-1]} SMs)"
            )
        try:
            if m.arrival.kind == "trace":
                _read_trace(m.arrival.trace)
            if not workload.mean_rate(m) > 0:
                problems.append(f"model {m.name!r}: no requests arrive within the {workload.duration_s:g} s duration")
        except WorkloadError as e:
            problems.append(f"model {m.name!r}: {e}")
    if problems:
        raise WorkloadError("invalid workload:\n  " + "\n  ".join(problems))


# -- arrivals -------------------------------------------------------------------------------
def model_seed(seed: int, model: str) -> int:
    """A per-model seed that is stable across runs and Python versions (no ``hash()``)."""
    digest = hashlib.sha256(f"gpuloom:{seed}:{model}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def arrival_times(workload: Workload) -> dict[str, list[float]]:
    """Arrival timestamps (s, ascending, within ``[0, duration_s)``) of every model.

    Deterministic: model ``m`` draws from ``random.Random(model_seed(seed, m))``, so adding or
    removing another model does not change ``m``'s arrivals.
    """
    return {
        m.name: m.arrival.times(workload.duration_s, random.Random(model_seed(workload.seed, m.name)))
        for m in workload.models
    }


def deadlines_ms(workload: Workload, times: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
    """Each request's time to its deadline, ms, per model in the order of ``times[model]`` (its
    arrivals): the model's SLO, or with ``deadline_factors`` one of them x the SLO, drawn from a
    stream of its own (the arrivals stay the ones drawn without it)."""
    out = {}
    for m in workload.models:
        n = len(times[m.name])
        if not m.deadline_factors:
            out[m.name] = [m.slo_ms] * n
            continue
        rng = random.Random(model_seed(workload.seed, "deadline:" + m.name))
        out[m.name] = [rng.choice(m.deadline_factors) * m.slo_ms for _ in range(n)]
    return out


def _poisson(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    out = []
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return out
        out.append(t)


_TRACE_CACHE: dict[str, tuple[float, ...]] = {}


def _read_trace(path: str | None) -> tuple[float, ...]:
    if path is None:
        raise WorkloadError("trace arrival without a trace path")
    if path in _TRACE_CACHE:
        return _TRACE_CACHE[path]
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"trace file {path!r} does not exist")
    ts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            t = float(line)
        except ValueError:
            raise WorkloadError(f"trace {path}:{n}: expected a timestamp in seconds, found {line!r}") from None
        if not (t >= 0 and math.isfinite(t)):
            raise WorkloadError(f"trace {path}:{n}: timestamps must be >= 0 seconds, found {t}")
        if ts and t < ts[-1]:
            raise WorkloadError(f"trace {path}:{n}: timestamps must ascend, found {t} after {ts[-1]}")
        ts.append(t)
    if not ts:
        raise WorkloadError(f"trace file {path!r} holds no timestamps")
    _TRACE_CACHE[path] = tuple(ts)
    return _TRACE_CACHE[path]


def _trace_period(ts: Sequence[float]) -> float:
    """Length (s) after which a trace repeats: its last timestamp plus one mean gap (one second where
    that is none: every timestamp 0, which repeated every 0 s never reached the run's end)."""
    if len(ts) < 2:
        return max(ts[-1], 1.0) if ts else 1.0
    period = ts[-1] + (ts[-1] - ts[0]) / (len(ts) - 1)
    return period if period > 0 else 1.0


# -- profiles for a workload -----------------------------------------------------------------
def resolve_profiles(
    workload: Workload,
    *,
    profiles_dir: str | Path | None = None,
    gpu: str | None = None,
    synthetic: bool = False,
) -> "tuple[ProfileStore, list[str]]":
    """The profile store to plan/simulate ``workload`` against, and warnings to show the user.

    * ``synthetic``: the synthetic zoo (``gpuloom.profile.synthetic.zoo()``), no GPU facts.
    * ``profiles_dir``: the profiles in that directory (an error if it holds none).
    * otherwise the shipped profiles of ``gpu`` (default: the workload's ``gpu``). If none are
      shipped yet, fall back to the synthetic zoo; models missing from the shipped set are taken
      from the zoo when it has them. Each fallback adds a warning.
    """
    from gpuloom.profile.store import ProfileError, ProfileStore
    from gpuloom.profile.synthetic import zoo

    if synthetic:
        return ProfileStore(profiles=zoo()), ["planning against SYNTHETIC profiles (gpuloom.profile.synthetic.zoo)"]
    if profiles_dir is not None:
        d = Path(profiles_dir)
        if not d.is_dir():
            raise WorkloadError(f"profile directory {str(d)!r} does not exist")
        store = ProfileStore(d)
        if not len(store):
            raise WorkloadError(f"profile directory {str(d)!r} holds no *.json profiles")
        return store, []
    gpu = gpu or workload.gpu
    try:
        store = ProfileStore.builtin(gpu)
    except ProfileError:
        store = ProfileStore()
    if not len(store):
        return ProfileStore(profiles=zoo()), [
            f"no shipped profiles for GPU {gpu!r} yet: falling back to SYNTHETIC profiles "
            "(gpuloom.profile.synthetic.zoo); numbers are illustrative, not measured"
        ]
    warnings = []
    synth = {p.model: p for p in zoo()}
    missing = [m.name for m in workload.models if m.name not in store]
    filled = [m for m in missing if m in synth]
    if filled:  # a directory-less copy, so nothing is ever written into the shipped profiles
        store = ProfileStore(profiles=[*store, *(synth[m] for m in filled)])
        warnings.append(f"no measured {gpu} profile for {filled}: using SYNTHETIC profiles for them")
    return store, warnings
