"""TTFT of a prefill/decode pair split into its parts, through the two-leg protocol a router
runs (no router in between, so nothing else is timed).

    python scripts/pd_split.py --prefill URL --decode URL --isl 8193 --osl 32 --prompts 6

For each prompt (random token ids, a fresh prefix every time):
  prefill   the producer's leg (max_tokens 1, do_remote_decode), wall time of the request;
  transfer  the consumer's NIXL pull time for that request (its /metrics summary delta);
  decode    the consumer's time to first token less the transfer (claim, the last prompt
            token's forward, first sample).
It then runs the same prompt again on the producer (a prefix-cache hit on the very KV that was
transferred: with --isl k*128+1 the same computation the consumer ran) and compares the greedy
texts (and the reference with itself, run twice: the baseline of run-to-run agreement on one
server), and runs a fresh prompt on the producer alone for the co-located TTFT. Run the
servers with prefix caching on. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("m3serve:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0]] = float(value)
    return out


def stream(url: str, body: dict) -> tuple[float, list[int], dict]:
    """(seconds to the first token, the text pieces)."""
    t0, first, pieces = time.perf_counter(), None, []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: {r.status_code} {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"{url}: {event['error']}")
            for choice in event.get("choices", []):
                if first is None:                   # the first token, even one without text yet
                    first = time.perf_counter() - t0
                pieces.append(choice.get("text") or "")
    return first or float("nan"), pieces


def agree(a: list[str], b: list[str]) -> int:
    """How many leading pieces two streams share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--isl", type=int, default=8193)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=100000)
    args = ap.parse_args()
    model = args.model or httpx.get(args.decode + "/v1/models", timeout=30).json()["data"][0]["id"]
    rng = random.Random(0)
    rows = []
    for i in range(args.prompts + 1):              # the first is a warm-up
        prompt = [rng.randrange(1000, args.vocab) for _ in range(args.isl)]
        body = {"model": model, "prompt": prompt, "max_tokens": args.osl, "temperature": 0, "ignore_eos": True}
        before = scrape(args.decode)
        t0 = time.perf_counter()
        leg = httpx.post(args.prefill + "/v1/completions", timeout=600, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        prefill_s = time.perf_counter() - t0
        if leg.status_code != 200:
            raise SystemExit(f"prefill leg: {leg.status_code} {leg.text[:300]}")
        params = leg.json()["kv_transfer_params"]
        ttft_d, pd_text = stream(args.decode, {**body, "kv_transfer_params": params})
        after = scrape(args.decode)
        xfer_n = after.get("m3serve:nixl_xfer_time_seconds_count", 0) - before.get(
            "m3serve:nixl_xfer_time_seconds_count", 0)
        xfer_s = (after.get("m3serve:nixl_xfer_time_seconds_sum", 0) - before.get(
            "m3serve:nixl_xfer_time_seconds_sum", 0)) / max(xfer_n, 1)
        nbytes = after.get("m3serve:nixl_bytes_transferred_total", 0) - before.get(
            "m3serve:nixl_bytes_transferred_total", 0)
        pulls = after.get("m3serve:kv_transfer_pulls_total", 0) - before.get("m3serve:kv_transfer_pulls_total", 0)
        # the same prompt again on the producer: its own copy of the prompt's KV is in its prefix
        # cache, so with isl = k * 128 + 1 it computes exactly what the consumer computed (one
        # token on 8192 cached ones); a byte-exact transfer gives the same greedy text
        _, ref_text = stream(args.prefill, body)
        _, ref_again = stream(args.prefill, body)      # the single server against itself
        # co-located TTFT: a fresh prompt on the producer alone
        fresh = [rng.randrange(1000, args.vocab) for _ in range(args.isl)]
        ttft_local, _ = stream(args.prefill, {**body, "prompt": fresh})
        if i == 0:
            continue
        same, self_same = agree(pd_text, ref_text), agree(ref_again, ref_text)
        rows.append({"prefill_s": prefill_s, "transfer_s": xfer_s, "decode_first_s": ttft_d - xfer_s,
                     "ttft_pd_s": prefill_s + ttft_d, "ttft_local_s": ttft_local, "bytes": nbytes,
                     "pulls": pulls, "gbps": nbytes / xfer_s / 1e9 if xfer_s > 0 else None,
                     "pieces": len(pd_text), "agree_prefix": same, "equal": pd_text == ref_text,
                     "ref_self_agree_prefix": self_same})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], (int, float))}
    print(json.dumps({"isl": args.isl, "osl": args.osl, "prompts": args.prompts, "median": med, "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
