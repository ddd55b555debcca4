"""`m3serve route`: start an installed router (vllm-router or smg) in front of m3serve workers,
with the flags m3serve workers need. Not a router of our own: this process becomes the router.

Plain mode: `--worker URL ...`. P/D mode: `--prefill URL ... --decode URL ...` (workers started
with `--kv-transfer-config`, kv_producer and kv_consumer). What each router needs:
- vllm-router speaks the NIXL protocol in P/D mode by itself; its P/D legs carry
  `Authorization: Bearer $OPENAI_API_KEY` of its own environment, so `--worker-api-key` is put
  there (workers started with `--api-key` then accept them; clients' keys are not forwarded).
- smg tags prefill legs with `kv_transfer_params` only for workers labelled with the
  `NixlConnector` connector: the workers go into a discovery manifest (`--manifest`, default in
  the cache folder) that says so. `--worker-api-key` becomes smg's `--api-key`, which it uses
  towards the workers and also requires from its clients.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from m3serve import envs

ROUTERS = ("vllm-router", "smg")
_INSTALL = {"vllm-router": "pip install vllm-router", "smg": "pip install smg"}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", choices=ROUTERS, default="vllm-router")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--worker", nargs="+", default=[], metavar="URL", help="plain mode: worker URLs")
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="P/D: prefill workers (kv_producer)")
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL", help="P/D: decode workers (kv_consumer)")
    parser.add_argument("--policy", default="round_robin",
                        help="load-balancing policy of the router (e.g. round_robin, cache_aware, power_of_two)")
    parser.add_argument("--prometheus-port", type=int, default=None, help="the router's metrics port")
    parser.add_argument("--worker-api-key", default=None,
                        help="the workers' --api-key (vllm-router sends it on P/D legs)")
    parser.add_argument("--manifest", default=None, help="smg: where to write the worker manifest")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("router_args", nargs=argparse.REMAINDER,
                        help="after --: more flags for the router itself")


def _check_urls(urls: list[str], flag: str) -> None:
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{flag} {url!r}: worker URLs start with http:// or https://")


def router_command(args) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) that start the router for these workers."""
    pd = bool(args.prefill or args.decode)
    if pd and args.worker:
        raise ValueError("give either --worker (plain mode) or --prefill/--decode (P/D mode), not both")
    if pd and not (args.prefill and args.decode):
        raise ValueError("P/D mode needs at least one --prefill and one --decode worker")
    if not pd and not args.worker:
        raise ValueError("no workers: give --worker URL ..., or --prefill URL ... --decode URL ...")
    for urls, flag in ((args.worker, "--worker"), (args.prefill, "--prefill"), (args.decode, "--decode")):
        _check_urls(urls, flag)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    extra = [a for a in args.router_args if a != "--"]
    env: dict[str, str] = {}
    metrics = [] if args.prometheus_port is None else ["--prometheus-port", str(args.prometheus_port)]
    if args.router == "vllm-router":
        argv = ["vllm-router", "--host", args.host, "--port", str(args.port), "--policy", args.policy, *metrics]
        if pd:
            argv += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
            for url in args.prefill:
                argv += ["--prefill", url]
            for url in args.decode:
                argv += ["--decode", url]
        else:
            argv += ["--worker-urls", *args.worker]
        if args.worker_api_key:
            env["OPENAI_API_KEY"] = args.worker_api_key       # the P/D legs' bearer token
            argv += ["--api-key", args.worker_api_key]        # the probes' (render, tokenize)
        return argv + extra, env
    argv = ["smg", "launch", "--host", args.host, "--port", str(args.port), "--policy", args.policy, *metrics]
    if args.worker_api_key:
        argv += ["--api-key", args.worker_api_key]
    if args.prometheus_port is not None:
        argv += ["--prometheus-host", args.host]
    if not pd:
        return argv + ["--worker-urls", *args.worker] + extra, env
    workers = [{"id": f"prefill-{i}", "url": u, "worker_type": "prefill", "kv_connector": "NixlConnector"}
               for i, u in enumerate(args.prefill)]
    workers += [{"id": f"decode-{i}", "url": u, "worker_type": "decode"} for i, u in enumerate(args.decode)]
    manifest = Path(args.manifest or Path(envs.CACHE_DIR) / f"smg-workers-{args.port}.json")
    manifest.parent.mkdir(parents=True, exist_ok=True)
    tmp = manifest.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 1, "workers": workers}, indent=1))
    tmp.replace(manifest)
    argv += ["--pd-disaggregation", "--discovery-provider", "file", "--discovery-file", str(manifest)]
    return argv + extra, env


def main(args) -> int:
    argv, env = router_command(args)
    if args.dry_run:
        print(" ".join(f"{k}=***" for k in env), " ".join(argv))
        return 0
    binary = shutil.which(argv[0])
    if binary is None:
        raise ValueError(f"{argv[0]} is not installed ({_INSTALL[argv[0]]})")
    os.execve(binary, argv, {**os.environ, **env})
    return 0  # not reached
