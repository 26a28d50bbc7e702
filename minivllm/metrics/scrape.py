"""Reading a Prometheus text page back: what a dashboard, an alert rule or a billing job does with ``/metrics``.

One parser for the whole project (labs and tests alike), on top of prometheus_client's own text parser:
:func:`metric_samples` turns a page into ``{(sample name, frozenset(labels)): value}`` and
:func:`metric_value` sums the samples of one name whose labels include the ones asked for -- PromQL's
``sum(name{label="value"})`` without the time window.  :func:`label_values` lists the values a label takes
(which tenants, which models a page has series for).  Pages scraped from replicas that
label their series with different ``model_name`` values (the fleet's replicas do) merge with ``{**a, **b}``;
two replicas of one model name would overwrite each other's samples there, so such pages need a label of their
own first (Prometheus adds ``instance``).
"""

from __future__ import annotations


def metric_samples(text: str) -> dict:
    """``{(sample name, frozenset(labels)): value}`` of a Prometheus text page, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric_value(samples: dict, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def label_values(samples: dict, name: str, label: str) -> list[str]:
    """The sorted values ``label`` takes on the samples called ``name`` (e.g. every tenant with a token counter)."""
    return sorted({dict(ls)[label] for (n, ls) in samples if n == name and label in dict(ls)})
