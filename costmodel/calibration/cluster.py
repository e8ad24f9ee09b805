"""Fit a cluster profile's links from collective measurements (alpha-beta plus an efficiency curve).

Ring accounting (nccl-tests): for a group of n ranks and a message of `nbytes`,
    all_reduce:                          steps 2(n−1), bus bytes 2(n−1)/n · nbytes
    all_gather, reduce_scatter, all_to_all: steps n−1,  bus bytes (n−1)/n · nbytes
    send_recv:                           steps 1,      bus bytes nbytes
`fit.alpha_beta` fits t = steps·alpha + bus_bytes/beta over every fit point; the
per-message-size efficiency e(nbytes) = bus_bytes / (beta · (t − steps·alpha)) is binned by size, and
`bandwidth_gbps` is beta raised to the fastest point so that e ≤ 1. The knots and the latency are then
refined through `costmodel.collectives.collective_time` on the fit set (`fit.refine_knots`).

A local machine has one link level: `inter_node` carries the same figures as `intra_node`, noted as
such. What the shared curve cannot express (gloo's algorithms differ per collective and per group size
on an oversubscribed CPU) is fitted as data: a factor curve against message bytes per collective and
group size (`collective_factors`, key `kind/n`, n the group `collective_time` sees: 2 for send/recv),
on the fit set through `collective_time` (`fit.fit_factor_curve`), which reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from costmodel.calibration.fit import alpha_beta, efficiency_points, fit_factor_curve, mean_abs_log_error, refine_knots
from costmodel.calibration.predict import comm_group, predict_comm
from costmodel.calibration.microbench_comm import CommSample
from costmodel.profiles import ClusterSpec, EfficiencyCurve, FactorCurve, cluster_from_dict


def ring_terms(kind: str, n: int) -> tuple[float, float]:
    """(latency steps, bus-bytes factor) of a ring collective on n ranks."""
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if kind == "send_recv":
        return 1.0, 1.0
    return float(n - 1), (n - 1) / n


def comm_key(case) -> str:
    """`kind/n`, the key of a collective's factor curve (n: the group `collective_time` prices)."""
    return f"{case.kind}/{comm_group(case).size}"


def with_factors(spec: ClusterSpec, factors: dict[str, tuple[tuple[float, float], ...]]) -> ClusterSpec:
    """`spec` with these collective factor curves on both link levels."""
    table = {k: FactorCurve(v) for k, v in factors.items()}
    return dataclasses.replace(spec, intra_node=dataclasses.replace(spec.intra_node, collective_factors=table),
                               inter_node=dataclasses.replace(spec.inter_node, collective_factors=table))


def fit_collective_factors(spec: ClusterSpec, samples: Sequence[CommSample]) -> dict[str, tuple[tuple[float, float], ...]]:
    """A factor curve against message bytes per collective and group size, each fitted on its own points."""
    table = {}
    for key in sorted({comm_key(s.case) for s in samples}):
        group = [s for s in samples if comm_key(s.case) == key]

        def price(points, key=key, group=group) -> list[float]:
            trial = with_factors(spec, {key: points})
            return [predict_comm(s.case, trial) for s in group]

        curve = fit_factor_curve([s.case.nbytes for s in group], [s.seconds for s in group], price)
        if curve is not None:
            table[key] = curve
    return table


def _group(s: CommSample) -> int:
    return 2 if s.case.kind == "send_recv" else s.case.group_size


def _num(value: float, source: str) -> dict:
    return {"value": float(f"{value:.4g}"), "source": source}


def closed_form_link(samples: Sequence[CommSample], source: str) -> dict:
    terms = [ring_terms(s.case.kind, _group(s)) for s in samples]
    steps = [st for st, _ in terms]
    bus = [f * s.case.nbytes for (_, f), s in zip(terms, samples)]
    seconds = [s.seconds for s in samples]
    ab = alpha_beta(steps, bus, seconds)
    effs = [b / (ab.beta * max(t - st * ab.alpha_s, 0.05 * t)) for st, b, t in zip(steps, bus, seconds)]
    points = efficiency_points([s.case.nbytes for s in samples], effs)
    top = max(e for _, e in points)
    bandwidth = ab.beta * max(top, 1.0)
    points = tuple((x, e / max(top, 1.0)) for x, e in points)
    return {
        "bandwidth_gbps": _num(bandwidth / 1e9, source),
        "latency_us": _num(ab.alpha_s * 1e6, source),
        "efficiency": {
            "points": [[float(x), float(f"{e:.4g}")] for x, e in points],
            "source": source,
            "fit": {"alpha_us": float(f"{ab.alpha_s * 1e6:.4g}"), "beta_gbps": float(f"{ab.beta / 1e9:.4g}")},
        },
        "sharp": False,
    }


def cluster_json(*, name: str, description: str, device_json: dict, gpus_per_node: int, link: dict) -> dict:
    inter = {**link, "notes": "same figures as intra_node: a single machine has no inter-node link"}
    return {
        "schema_version": 1,
        "name": name,
        "description": description,
        "device": device_json,
        "gpus_per_node": gpus_per_node,
        "tp_across_nodes": False,
        "links": {"intra_node": link, "inter_node": inter},
    }


def refine_link(cluster: dict, samples: Sequence[CommSample]) -> dict:
    """Refine the intra-node latency and efficiency knots through `collective_time`; then fit the
    collective factor curves."""
    base: ClusterSpec = cluster_from_dict(cluster)
    knots = base.intra_node.efficiency.points
    measured = [s.seconds for s in samples]

    def spec_for(values: Sequence[float]) -> ClusterSpec:
        link = dataclasses.replace(
            base.intra_node, latency_s=values[0], efficiency=EfficiencyCurve(tuple((x, v) for (x, _), v in zip(knots, values[1:])))
        )
        return dataclasses.replace(base, intra_node=link, inter_node=dataclasses.replace(link, name="inter_node"))

    def objective(values: Sequence[float]) -> float:
        spec = spec_for(values)
        return mean_abs_log_error([predict_comm(s.case, spec) for s in samples], measured)

    latency = max(base.intra_node.latency_s, 1e-6)
    values = refine_knots([latency, *(e for _, e in knots)], objective,
                          bounds=[(0.0, 100 * latency)] + [(1e-4, 1.0)] * len(knots))
    factors = fit_collective_factors(spec_for(values), samples)
    link = dict(cluster["links"]["intra_node"])
    source = link["latency_us"]["source"]
    link["latency_us"] = _num(values[0] * 1e6, source)
    link["efficiency"] = {
        **link["efficiency"],
        "points": [[float(x), float(f"{v:.4g}")] for (x, _), v in zip(knots, values[1:])],
    }
    if factors:
        link["collective_factors"] = {"source": source, "factors": {k: [list(p) for p in v] for k, v in factors.items()}}
    return cluster_json(name=cluster["name"], description=cluster["description"], device_json=cluster["device"],
                        gpus_per_node=cluster["gpus_per_node"], link=link)
