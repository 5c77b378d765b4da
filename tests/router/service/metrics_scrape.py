"""Scrape a /metrics endpoint over real HTTP and look samples up by name and labels."""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    """One scrape: every sample as (name, labels) -> value, and the family names."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    families: frozenset[str]
    text: str

    def get(self, name: str, **labels: str) -> float:
        """The one sample named ``name`` whose labels include ``labels`` (KeyError if none,
        AssertionError if several)."""
        want = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and want <= ls]
        if not found:
            raise KeyError(f"no sample {name}{labels} in the scrape")
        assert len(found) == 1, f"{len(found)} samples match {name}{labels}"
        return found[0]

    def total(self, name: str, **labels: str) -> float:
        """Sum of every sample named ``name`` whose labels include ``labels`` (0 if none)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def names(self) -> set[str]:
        return {n for n, _ in self.samples}


def parse(text: str) -> Scrape:
    samples = {}
    families = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return Scrape(samples, frozenset(families), text)


def scrape_sync(url: str, timeout_s: float = 5.0) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        assert resp.status == 200
        assert resp.headers.get_content_type() == "text/plain"
        return parse(resp.read().decode())


async def scrape(url: str) -> Scrape:
    """GET ``url`` from a thread (the endpoint may need this event loop to answer)."""
    return await asyncio.to_thread(scrape_sync, url)
