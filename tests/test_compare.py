"""`soap compare` (issue 32): the smallest GPU count is minimal, the cheaper-per-token cluster ranks first,
the knee and the count ladder follow their definitions, and bad input is one `error:` line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodel.profiles import PROFILES_DIR
from planner.api import plan_report
from planner.compare import KNEE_GAIN, compare, gpu_ladder, knee, smallest_fitting, step_grid
from planner.prices import Price, parse_price_flag, read_price_file, resolve_prices
from soap.cli import main
from tracer.errors import SoapError

FRUGAL = dict(seq_len=512, zero=3, recompute="full", micro_batch=1, compile="off", cp=1, pp=1, offload="off")
"""Pins that keep each search small; with a tight --mem-limit only the GPU count decides what fits."""


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    """dgx-h100 cut into 2-GPU nodes, so whole-node steps (2) are finer than the ladder's doublings."""
    data = json.loads((PROFILES_DIR / "clusters" / "dgx-h100.json").read_text())
    data.update(name="pairs", gpus_per_node=2)
    path = tmp_path_factory.mktemp("clusters") / "pairs.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_smallest_gpu_count_is_minimal_one_step_fewer_does_not_fit(pairs):
    result = compare("llama-3-8b", clusters=[pairs], prices={pairs: Price(1.0, "test", "test")}, gpus="auto",
                     max_gpus=16, mem_limit_gib=16, **FRUGAL).clusters[0]
    smallest = result.min_gpus
    assert smallest not in gpu_ladder(2, 2, 16), "the bisection between ladder counts should have been exercised"
    fewer = max(g for g in step_grid(2, 16) if g < smallest)
    assert smallest - fewer == 2  # one node fewer
    with pytest.raises(SoapError, match="does not fit"):
        plan_report("llama-3-8b", gpus=fewer, cluster=pairs, mem_limit_gib=16, **FRUGAL)
    assert plan_report("llama-3-8b", gpus=smallest, cluster=pairs, mem_limit_gib=16, **FRUGAL).plan is not None
    assert result.point(smallest).fits and not result.point(fewer).fits


@pytest.mark.parametrize("cheap", ["dgx-h100", "dgx-a100-80g"])
def test_cheaper_per_token_cluster_ranks_first(cheap):
    prices = {"dgx-h100": Price(100.0, "test", "test"), "dgx-a100-80g": Price(100.0, "test", "test")}
    prices[cheap] = Price(0.5, "test", "test")
    comparison = compare("gpt2", clusters=["dgx-h100", "dgx-a100-80g"], prices=prices, gpus=8, seq_len=512)
    costs = [r.cost_per_million for r in comparison.clusters]
    assert comparison.clusters[0].name == cheap and costs == sorted(costs)
    point = comparison.clusters[0].chosen
    expected = 8 * 0.5 / 3600 * 1e6 / point.tokens_per_s
    assert comparison.clusters[0].cost_per_million == pytest.approx(expected)


def test_smallest_fitting_matches_brute_force_on_the_grid():
    grid = step_grid(8, 256)
    ladder = gpu_ladder(8, 8, 256)
    for threshold in range(1, 257):
        found = smallest_fitting(ladder, tuple(sorted(set(grid) | set(ladder))), lambda n: n >= threshold)
        assert found == min(g for g in grid if g >= threshold), threshold
    assert smallest_fitting(ladder, grid, lambda n: False) is None


def test_ladder_has_powers_of_two_node_doublings_and_domain_multiples():
    assert gpu_ladder(8, 8, 64) == (1, 2, 4, 8, 16, 32, 64)
    assert gpu_ladder(4, 72, 160) == (1, 2, 4, 8, 16, 32, 64, 72, 128, 144)
    assert step_grid(4, 20) == (1, 2, 4, 8, 12, 16, 20)


def test_knee_is_the_first_count_whose_doubling_gains_too_little():
    curve = {4: 100.0, 8: 195.0, 16: 380.0, 32: 380.0 * (KNEE_GAIN - 0.1), 64: 700.0}
    assert knee(curve, 4) == (16, True)
    assert knee({4: 100.0, 8: 200.0}, 4) == (8, False)


def test_prices_parse_and_the_shipped_file_is_dated_and_sourced():
    assert parse_price_flag("a=2.5, b=3") == {"a": 2.5, "b": 3.0}
    shipped = read_price_file()
    assert shipped and all(p.as_of and p.source for p in shipped.values())
    prices = resolve_prices(["dgx-h100", "dgx-b200"], {"dgx-b200": 9.0})
    assert prices["dgx-b200"].usd_per_gpu_hour == 9.0 and prices["dgx-b200"].as_of == "given on the command line"
    assert prices["dgx-h100"] == shipped["dgx-h100"]


def test_json_is_one_object_and_png_is_drawn(capsys, tmp_path):
    png = tmp_path / "cost.png"
    code = main(["compare", "gpt2", "--clusters", "dgx-h100,dgx-b200", "--gpus", "8", "--seq-len", "512",
                 "--price", "dgx-h100=2,dgx-b200=5", "--tokens", "1e9", "--json", "--png", str(png)])
    out = capsys.readouterr().out
    assert code == 0 and png.stat().st_size > 0
    data = json.loads(out)
    assert data["ranking"] == [c["cluster"] for c in data["clusters"]] and data["gpus"] == 8
    for row in data["clusters"]:
        assert row["fits"] and row["train_time_s"] == pytest.approx(1e9 / row["tokens_per_s"])
        assert {"plan", "step_time_s", "mfu", "peak_memory_gib", "cost_per_million_tokens_usd", "price"} <= set(row)


@pytest.mark.parametrize("argv, message", [
    (["--clusters", "dgx-h100,nope"], "unknown cluster 'nope'"),
    (["--clusters", "dgx-h100,mi300x-8"], "no price for mi300x-8"),
    (["--clusters", "dgx-h100", "--price", "dgx-h100=-1"], "positive price"),
    (["--clusters", "dgx-h100", "--price", "dgx-b200=3"], "not among --clusters"),
    (["--clusters", "dgx-h100,dgx-h100"], "twice"),
    (["--clusters", "dgx-h100", "--tokens", "0"], "--tokens"),
    (["--clusters", "dgx-h100", "--gpus", "0"], "--gpus"),
    (["--clusters", "dgx-h100", "--gpus", "many"], "not a GPU count"),
    (["--clusters", "dgx-h100", "--max-gpus", "0"], "--max-gpus"),
    (["--clusters", "dgx-h100", "--prices", "/nonexistent/prices.json"], "does not exist"),
    (["--clusters", "dgx-h100", "--gpus", "1", "--mem-limit", "0.2", "--no-offload", "--seq-len", "512"], "fits on none"),
])
def test_bad_input_is_one_error_line_and_exit_2(argv, message, capsys):
    try:
        code = main(["compare", "gpt2", *argv])
    except SystemExit as exc:  # argparse's usage errors leave through soap's one-line parser
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
