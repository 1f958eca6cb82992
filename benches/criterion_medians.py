"""Prints the medians of the last `cargo bench` run (target/criterion) as a Markdown table.

cargo bench --bench kv_cache && python3 benches/criterion_medians.py
"""

import json
import pathlib
import sys


def format_ns(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.0f} ns"


def main(root: str = "target/criterion") -> None:
    rows = []
    for estimates in sorted(pathlib.Path(root).glob("**/new/estimates.json")):
        bench = json.loads((estimates.parent / "benchmark.json").read_text())
        median = json.loads(estimates.read_text())["median"]
        low = median["confidence_interval"]["lower_bound"]
        high = median["confidence_interval"]["upper_bound"]
        rows.append((bench["full_id"], median["point_estimate"], low, high))
    print("| bench | median | 95% CI of the median |")
    print("|---|---|---|")
    for name, point, low, high in rows:
        print(f"| `{name}` | {format_ns(point)} | {format_ns(low)} – {format_ns(high)} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
