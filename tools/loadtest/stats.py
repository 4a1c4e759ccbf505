"""The load test's counters: latencies and statuses per endpoint, merged over processes, and their summaries."""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from deploy_core.timing import percentile

__all__ = ["GENERATOR_BUSY", "Stats", "digest"]


@dataclass
class Stats:
    """Latencies (ms, answered requests only) and statuses per endpoint, diverged tracks apart; a shared
    request budget."""

    max_requests: int
    deadline: float
    sent: int = 0
    latencies_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # status < 400 only
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    diverged: Counter = field(default_factory=Counter)  # endpoint -> tracks refused for the pose's range
    transport_errors: Counter = field(default_factory=Counter)
    error_samples: dict[str, str] = field(default_factory=dict)  # "endpoint status" -> first error message
    refusals_without_retry_after: Counter = field(default_factory=Counter)  # "endpoint status" -> count
    ok_window: dict[str, tuple[float, float]] = field(default_factory=dict)  # first / last answered, time.time()
    outside_ms: list[float] = field(default_factory=list)  # per answered stream frame: round trip - server phases
    stateless_tracks: int = 0  # answered HTTP tracks sent without a session (after it diverged, --on-diverge stateless)

    def record(self, name: str, ms: float, status: int) -> None:
        self.statuses[name][status] += 1
        if status < 400:  # percentiles of answered requests; the window: throughput without the ramp-up
            self.latencies_ms[name].append(ms)
            now = time.time()
            first, _ = self.ok_window.get(name, (now, now))
            self.ok_window[name] = (first, now)

    def to_dict(self) -> dict:
        """Plain data (picklable) for the parent process."""
        return {"latencies_ms": dict(self.latencies_ms), "statuses": {k: dict(v) for k, v in self.statuses.items()},
                "diverged": dict(self.diverged),
                "transport_errors": dict(self.transport_errors), "error_samples": dict(self.error_samples),
                "refusals_without_retry_after": dict(self.refusals_without_retry_after),
                "ok_window": dict(self.ok_window), "outside_ms": list(self.outside_ms),
                "stateless_tracks": self.stateless_tracks}

    def merge(self, part: dict) -> None:
        for name, (first, last) in part.get("ok_window", {}).items():
            old = self.ok_window.get(name, (first, last))
            self.ok_window[name] = (min(old[0], first), max(old[1], last))
        for name, values in part["latencies_ms"].items():
            self.latencies_ms[name].extend(values)
        for name, counts in part["statuses"].items():
            self.statuses[name].update(counts)
        self.transport_errors.update(part["transport_errors"])
        self.diverged.update(part.get("diverged", {}))
        self.refusals_without_retry_after.update(part.get("refusals_without_retry_after", {}))
        self.outside_ms.extend(part.get("outside_ms", ()))
        self.stateless_tracks += part.get("stateless_tracks", 0)
        for key, text in part["error_samples"].items():
            self.error_samples.setdefault(key, text)

    def over(self) -> bool:
        """The budget is spent or the deadline passed."""
        return self.sent >= self.max_requests or time.monotonic() >= self.deadline

    def take(self) -> bool:
        """Claim one request of the budget; False once the run is over."""
        if self.over():
            return False
        self.sent += 1
        return True

    def summary(self, elapsed_s: float) -> dict:
        endpoints = {}
        all_errors: Counter = Counter()
        for name in sorted(set(self.statuses) | set(self.diverged)):
            lat = sorted(self.latencies_ms[name])
            statuses = self.statuses[name]
            errors = {str(k): v for k, v in sorted(statuses.items()) if k >= 400}
            all_errors.update(errors)
            ok = sum(v for k, v in statuses.items() if k < 400)
            endpoints[name] = {
                "count": sum(statuses.values()) + self.diverged[name],
                "ok": ok,
                "diverged": self.diverged[name],
                "p50_ms": round(percentile(lat, 50), 2) if lat else None,
                "p90_ms": round(percentile(lat, 90), 2) if lat else None,
                "p99_ms": round(percentile(lat, 99), 2) if lat else None,
                "mean_ms": round(sum(lat) / len(lat), 2) if lat else None,
                "per_s": round(ok / elapsed_s, 2) if elapsed_s > 0 else None,
                "active_per_s": _rate(ok, self.ok_window.get(name)),
                "errors_by_status": errors,
            }
        total = sum(e["count"] for e in endpoints.values())

        def ok_per_s(*names: str) -> float | None:
            n = sum(endpoints[e]["ok"] for e in names if e in endpoints)
            return round(n / elapsed_s, 2) if elapsed_s > 0 else None

        return {
            "requests": total,
            "elapsed_s": round(elapsed_s, 2),
            "requests_per_s": round(total / elapsed_s, 2) if elapsed_s > 0 else None,
            "tracks_per_s": ok_per_s("track", "stream_frame"),
            "stateless_tracks": self.stateless_tracks,
            "registers_per_s": ok_per_s("register", "stream_register", "register_alongside"),
            "refusals": {name: sum(v for k, v in e["errors_by_status"].items() if k in ("429", "503"))
                         for name, e in endpoints.items()},
            "endpoints": endpoints,
            "errors_by_status": dict(sorted(all_errors.items())),
            "diverged": dict(sorted(self.diverged.items())),
            "transport_errors": dict(self.transport_errors),
            "refusals_without_retry_after": dict(sorted(self.refusals_without_retry_after.items())),
            "error_samples": dict(sorted(self.error_samples.items())),
            "stream_outside_phases_ms": _percentiles(self.outside_ms),
        }


def digest(summary: dict) -> str:
    """One line of a run's summary: what it reached and which regime it measured (diverged and stateless tracks,
    the lane's driver launches per batch, the track step's GPU median), for logs that are read before the JSON."""
    track = summary.get("endpoints", {}).get("track") or summary.get("endpoints", {}).get("stream_frame") or {}
    counts = summary.get("server_counts") or {}
    gpu = (summary.get("server_gpu_p50_ms") or {}).get("track/step")
    parts = [f"{summary.get('tracks_per_s')} tracks/s", f"{summary.get('registers_per_s')} registers/s",
             f"p50 {track.get('p50_ms')} ms p99 {track.get('p99_ms')} ms",
             f"diverged {sum(summary.get('diverged', {}).values())}",
             f"stateless {summary.get('stateless_tracks', 0)}"]
    if counts.get("track_batches"):
        parts.append(f"driver launches {counts.get('track_driver_launches') or 0:g} of {counts['track_batches']:g} batches")
    if gpu is not None:
        parts.append(f"track step GPU p50 {gpu} ms")
    return ", ".join(parts)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {f"p{q}_ms": round(percentile(ordered, q), 2) if ordered else None for q in (50, 90, 99)}


def _rate(n: int, window: tuple[float, float] | None) -> float | None:
    """Answers per second between the first and the last answer (None with fewer than two)."""
    if window is None or n < 2 or window[1] <= window[0]:
        return None
    return round((n - 1) / (window[1] - window[0]), 2)


GENERATOR_BUSY = 0.85  # a load process this busy (CPU seconds per window second) may be what limits the load


def _generator_summary(cpu_fractions: list[float]) -> dict:
    """The load processes' own CPU use over the window: ``{processes, cpu_fraction (each), busiest, saturated}``;
    warns on stderr when one is near a whole core (then the figures may be the generator's, not the server's)."""
    busiest = max(cpu_fractions)
    saturated = busiest >= GENERATOR_BUSY
    if saturated:
        print(f"loadtest: a load process used {busiest:.0%} of a core over the window: the load generator may be "
              "what limits these figures (more --processes, or fewer clients per process)", file=sys.stderr)
    return {"processes": len(cpu_fractions), "cpu_fraction": cpu_fractions, "busiest": busiest,
            "saturated": saturated}


def _setup_summary(parts: list[dict], timeout_s: float) -> dict:
    """The set-up phase over every worker process (see the module docstring)."""
    stats = Stats(max_requests=0, deadline=0.0)
    for part in parts:
        stats.merge(part["stats"])
    seconds = max(p["ended"] for p in parts) - min(p["started"] for p in parts)
    summary = stats.summary(seconds)
    register = next((e for name, e in summary["endpoints"].items() if name in ("register", "stream_register")), {})
    return {"seconds": round(seconds, 2), "timeout_s": timeout_s, "clients": sum(p["clients"] for p in parts),
            "sessions_ready": sum(p["ready"] for p in parts), "registers_ok": register.get("ok", 0),
            "registers_refused": sum(summary["refusals"].values()),
            "register_p50_ms": register.get("p50_ms"), "register_p99_ms": register.get("p99_ms"),
            "errors_by_status": summary["errors_by_status"], "transport_errors": summary["transport_errors"],
            "refusals_without_retry_after": summary["refusals_without_retry_after"],
            "error_samples": summary["error_samples"]}


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _labelled(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of every sample of ``name`` (labels as written in the exposition)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name):].rpartition(" ")
            out[labels.strip("{}")] = float(value)
    return out


# the server's counters whose change over set-up and window the summary reports (``server_counts``)
SERVER_COUNTERS = {"track_batches": "fp_track_batches_total", "track_batched_requests": "fp_track_batched_requests_total",
                   "track_inline": "fp_track_inline_total", "track_driver_launches": "fp_track_driver_launches_total",
                   "track_graph_captures": "fp_track_graph_captures_total"}


def _counter_deltas(before: str, after: str) -> dict[str, float | None]:
    """How much each of :data:`SERVER_COUNTERS` grew between two /metrics texts (None: the server has no such
    counter, e.g. a CPU lane without graphs)."""
    out: dict[str, float | None] = {}
    for key, name in SERVER_COUNTERS.items():
        b, a = _metric(before, name), _metric(after, name)
        out[key] = None if a is None else a - (b or 0.0)
    return out


def _stage_gpu_p50_ms(text: str) -> dict[str, float]:
    """``{"lane/stage": ms}``: each pipeline stage's recent median GPU time (CUDA events) as /metrics reports it at
    the end of the run; stages without GPU timing are absent."""
    out = {}
    for labels, seconds in _labelled(text, "fp_pipeline_stage_gpu_p50_seconds").items():
        fields = _label_fields(labels)
        out[f"{fields['lane']}/{fields['stage']}"] = round(seconds * 1e3, 4)
    return out


def _label_fields(labels: str) -> dict[str, str]:
    """``{name: value}`` of one sample's labels as :func:`_labelled` keys them (``a="x",b="y"``)."""
    return {name: value.strip('"') for name, value in (part.split("=", 1) for part in labels.split(","))}


def _histogram_means(before: str, after: str, name: str, key: str) -> dict[str, dict[str, float]]:
    """Mean ms per (endpoint, ``key``) over the run, from the _sum/_count deltas of a histogram."""
    def read(text: str) -> dict[str, float]:
        return {**{f"sum|{k}": v for k, v in _labelled(text, name + "_sum").items()},
                **{f"count|{k}": v for k, v in _labelled(text, name + "_count").items()}}

    b, a = read(before), read(after)
    out: dict[str, dict[str, float]] = {}
    for label_key, total in a.items():
        kind, labels = label_key.split("|", 1)
        if kind != "sum":
            continue
        count = a.get(f"count|{labels}", 0.0) - b.get(f"count|{labels}", 0.0)
        if count <= 0:
            continue
        fields = _label_fields(labels)
        endpoint, item = fields["endpoint"], fields[key]
        out.setdefault(endpoint, {})[item] = round((total - b.get(label_key, 0.0)) / count * 1e3, 3)
    return out
