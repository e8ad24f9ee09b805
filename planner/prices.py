"""GPU rental prices for `soap compare`: the user's `--price NAME=USD`, else a dated price file.

The shipped file, `profiles/prices.json`, maps a cluster profile name to `{"usd_per_gpu_hour", "as_of",
"source"}`. It is a user-editable default compiled from shared/reference/hardware.md, never a current
quote: each entry keeps the date its source gives (or says it is undated), and every price soap prints
carries that date and source (`Price`). A cluster with neither a `--price` nor an entry is refused with
one line naming the flag to give.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from costmodel.profiles import PROFILES_DIR
from tracer.errors import SoapError
from tracer.files import read_json

PRICE_FILE = PROFILES_DIR / "prices.json"


@dataclass(frozen=True)
class Price:
    usd_per_gpu_hour: float
    as_of: str
    """The date the source gives, "undated ..." where it gives none, or "given on the command line"."""
    source: str


def parse_price_flag(text: str | None) -> dict[str, float]:
    """`a=2.5,b=3` as {"a": 2.5, "b": 3.0}; a malformed item is a SoapError naming it."""
    prices: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        try:
            usd = float(value) if sep else math.nan
        except ValueError:
            usd = math.nan
        if not name.strip() or not (math.isfinite(usd) and usd > 0):
            raise SoapError(f"--price item {item.strip()!r} is not CLUSTER=USD with a positive price per GPU-hour; "
                            "e.g. --price dgx-h100=2.99,dgx-b200=5.98")
        prices[name.strip()] = usd
    return prices


def read_price_file(path: str | Path | None = None) -> dict[str, Price]:
    """The entries of a price file (default the shipped one), validated."""
    file = Path(path) if path is not None else PRICE_FILE
    data = read_json(file, what="price file", fix="fix the file or pass --price CLUSTER=USD")
    entries = data.get("prices") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise SoapError(f"price file {file}: expected an object with a \"prices\" object; fix the file")
    out: dict[str, Price] = {}
    for name, entry in entries.items():
        usd = entry.get("usd_per_gpu_hour") if isinstance(entry, dict) else None
        if isinstance(usd, bool) or not isinstance(usd, (int, float)) or not (math.isfinite(usd) and usd > 0) \
                or not all(isinstance(entry.get(k), str) and entry[k].strip() for k in ("as_of", "source")):
            raise SoapError(f"price file {file}: entry {name!r} needs a positive usd_per_gpu_hour, an as_of date "
                            "and a source; fix the file")
        out[name] = Price(float(usd), entry["as_of"], entry["source"])
    return out


def resolve_prices(clusters: Sequence[str], given: Mapping[str, float], file: str | Path | None = None) -> dict[str, Price]:
    """A price per cluster: the command line's first, else the file's. Names in `given` that are not
    among `clusters` and clusters with no price are errors."""
    stray = sorted(set(given) - set(clusters))
    if stray:
        raise SoapError(f"--price names {stray[0]!r}, which is not among --clusters ({', '.join(clusters)})")
    shipped = read_price_file(file) if set(clusters) - set(given) else {}
    prices: dict[str, Price] = {}
    for name in clusters:
        if name in given:
            prices[name] = Price(given[name], "given on the command line", "--price")
        elif name in shipped:
            prices[name] = shipped[name]
    missing = [name for name in clusters if name not in prices]
    if missing:
        where = file or PRICE_FILE
        raise SoapError(f"no price for {', '.join(missing)} in {where}; give it as --price "
                        f"{','.join(f'{m}=USD_PER_GPU_HOUR' for m in missing)}")
    return prices
