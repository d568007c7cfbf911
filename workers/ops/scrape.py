"""Reading Prometheus `/metrics` endpoints directly, for operator tools that run without a Prometheus.

`scrape(url)` fetches and parses one endpoint and never raises: an endpoint that is down or answers
something else comes back with its error. `Figures` sums what several endpoints report for one run
(the samples whose `prefix` label is that run's; TQ's own `tq_*` metrics have none and are kept).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, Mapping[str, str], float]


def metrics_url(where: str) -> str:
    """`host:port`, `http://host:port` or a whole URL, as the URL of its metrics page."""
    url = where if "://" in where else f"http://{where}"
    scheme, _, rest = url.partition("://")
    return url if "/" in rest else f"{scheme}://{rest}/metrics"


@dataclass(frozen=True)
class Scrape:
    """One endpoint's samples, or why there are none."""

    url: str
    samples: tuple[Sample, ...] = ()
    error: str | None = None

    @property
    def up(self) -> bool:
        return self.error is None


def scrape(url: str, *, timeout_s: float = 0.8) -> Scrape:
    """GET `url` and parse it as Prometheus text; a failure is the result's `error`, never an exception."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        return Scrape(url, error=f"HTTP {exc.code}")
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return Scrape(url, error=str(getattr(reason, "strerror", None) or reason) or type(exc).__name__)
    try:
        samples = tuple(
            (s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(body)
            for s in fam.samples
        )
    except (ValueError, TypeError, IndexError) as exc:
        return Scrape(url, error=f"not Prometheus text ({exc})")
    return Scrape(url, samples)


def scrape_all(urls: Iterable[str], *, timeout_s: float = 0.8) -> list[Scrape]:
    """Every endpoint at once, so a dead one costs one timeout, not one per endpoint; in the order given."""
    urls = list(urls)
    if not urls:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(urls))) as pool:
        return list(pool.map(lambda u: scrape(u, timeout_s=timeout_s), urls))


class Figures:
    """The samples of the endpoints that answered, for one run's `prefix` (and TQ's, which have none)."""

    def __init__(self, scrapes: Iterable[Scrape], prefix: str) -> None:
        self._samples = [
            s
            for sc in scrapes
            if sc.up
            for s in sc.samples
            if s[1].get("prefix", "") == prefix or s[0].startswith("tq_")
        ]

    def _matching(self, name: str, match: Mapping[str, str]) -> list[Sample]:
        return [s for s in self._samples if s[0] == name and all(s[1].get(k) == v for k, v in match.items())]

    def total(self, name: str, **match: str) -> float | None:
        """The sum of `name`'s samples (with these label values); None when no endpoint reports it."""
        found = self._matching(name, match)
        return sum(s[2] for s in found) if found else None

    def largest(self, name: str, **match: str) -> float | None:
        found = self._matching(name, match)
        return max(s[2] for s in found) if found else None

    def by(
        self, name: str, label: str, *, combine: Callable[[Iterable[float]], float] = sum
    ) -> dict[str, float] | None:
        """`name`'s samples combined per value of `label`; None when no endpoint reports it."""
        found = self._matching(name, {})
        if not found:
            return None
        grouped: dict[str, list[float]] = {}
        for _, labels, value in found:
            grouped.setdefault(labels.get(label, ""), []).append(value)
        return {k: combine(v) for k, v in grouped.items()}
