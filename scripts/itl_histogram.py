"""`python scripts/itl_histogram.py RESULT.json`: the distribution of the inter-token gaps in a
`m3serve bench serve --save-detailed` result (every request's gaps between text-carrying
chunks): percentiles and a histogram, to see whether a tail comes from a few long steps or
from many."""
import json
import sys

import numpy as np


def main(path: str) -> None:
    with open(path) as f:
        result = json.load(f)
    gaps = np.asarray([g for req in result["itls"] for g in req], dtype=np.float64) * 1e3   # ms
    if not gaps.size:
        print("no inter-token gaps in", path)
        return
    pct = {p: round(float(np.percentile(gaps, p)), 2) for p in (1, 10, 25, 50, 75, 90, 95, 99, 99.9)}
    print(json.dumps({"gaps": int(gaps.size), "mean_ms": round(float(gaps.mean()), 2), "percentiles_ms": pct}))
    edges = [0, 1, 2, 5, 10, 15, 20, 25, 30, 40, 50, 60, 80, 100, 200, 500, np.inf]
    counts, _ = np.histogram(gaps, bins=edges)
    for lo, hi, n in zip(edges, edges[1:], counts):
        print(f"{lo:>5}-{hi:<5} ms {n:8d} {n / gaps.size:7.2%}")


if __name__ == "__main__":
    main(sys.argv[1])
