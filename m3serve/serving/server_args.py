"""Flags of `m3serve serve` that belong to the API server rather than the engine (vLLM names):
host/port, TLS, API key, served model name, chat template and its default kwargs, parsers,
limits, and where media may come from and how large it may decode.
"""
from __future__ import annotations

import argparse
import json
import os
import ssl
from dataclasses import dataclass, field

from m3serve.multimodal.media import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_VIDEO_DECODED_BYTES
from m3serve.serving.chat_template import THINKING_MODES, check_reasoning_effort
from m3serve.serving.reasoning import get_reasoning_parser
from m3serve.serving.tool_parser import get_tool_parser

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20


# vLLM serve flags that MiniMax-M3 recipes pass and that have nothing to do in m3serve
NOT_APPLICABLE_FLAGS = {
    "--trust-remote-code": "m3serve implements MiniMax-M3 itself and runs no checkpoint code",
    "--enable-chunked-prefill": "prefill is always chunked by --max-num-batched-tokens",
    "--disable-log-requests": "m3serve does not log request contents",
    "--attention-backend": "m3serve has one attention implementation per device",
    "--moe-backend": "m3serve has one fused-MoE implementation per device",
    "--linear-backend": "m3serve picks its GEMM kernels itself",
}
_VALUED_FLAGS = ("--attention-backend", "--moe-backend", "--linear-backend")
METRIC_NAMES = ("both", "m3serve", "vllm")   # /metrics: both prefixes, or one


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None  # a file path; None = the checkpoint's template
    default_chat_template_kwargs: dict = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    retry_after_s: int = 1  # Retry-After of a 503 when the waiting queue is full
    uvicorn_log_level: str = "info"
    engine_ready_timeout_s: float = 900.0
    shutdown_timeout_s: float = 25.0    # drain: seconds running requests get after SIGTERM
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json
    metric_names: str = "both"          # /metrics: m3serve:*, vllm:* (vLLM's names) or both
    stream_interval: int = 1            # a streamed chunk waits for this many new tokens
    enable_response_store: bool = False  # /v1/responses: keep responses for previous_response_id
    responses_signing_key: str | None = None  # HMAC key of reasoning blobs (None: random per process)
    allowed_local_media_path: str | None = None   # file:// media only under this directory
    allowed_media_domains: str | None = None      # comma-separated hosts http(s) media may come from
    allow_private_media_addresses: bool = False   # http(s) media hosts may resolve to non-public addresses
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS              # decoded width x height (images, frames)
    max_video_decoded_bytes: int = DEFAULT_MAX_VIDEO_DECODED_BYTES  # RGB bytes of a video's sampled frames
    max_video_total_frames: int = 4096            # frames a video file may have
    ssl_keyfile: str | None = None                # TLS: the server's private key (PEM)
    ssl_certfile: str | None = None               # TLS: the server's certificate chain (PEM)
    ssl_ca_certs: str | None = None               # TLS: CA certificates that client certificates chain to
    ssl_cert_reqs: int = int(ssl.CERT_NONE)       # TLS: 0 no client certificate, 1 optional, 2 required

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError(f"default_chat_template_kwargs must be a JSON object, got "
                             f"{self.default_chat_template_kwargs!r}")
        mode = self.default_chat_template_kwargs.get("thinking_mode")
        if mode is not None and mode not in THINKING_MODES:
            raise ValueError(f"default_chat_template_kwargs.thinking_mode must be one of "
                             f"{list(THINKING_MODES)}, got {mode!r}")
        effort = self.default_chat_template_kwargs.get("reasoning_effort")
        if effort is not None:
            check_reasoning_effort(effort, "default_chat_template_kwargs.reasoning_effort")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be a positive integer, got {self.stream_interval}")
        if self.metric_names not in METRIC_NAMES:
            raise ValueError(f"metric_names must be both, m3serve or vllm, got {self.metric_names!r}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout_s}")
        if self.max_request_body_bytes <= 0:
            raise ValueError(f"max_request_body_bytes must be positive, got {self.max_request_body_bytes}")
        for name in ("max_image_pixels", "max_video_decoded_bytes", "max_video_total_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        self._check_tls()

    def _check_tls(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together (TLS needs both)")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r} is not a readable file")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {self.ssl_cert_reqs}")
        if self.ssl_certfile is None and (self.ssl_ca_certs is not None or self.ssl_cert_reqs):
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CAs client certificates chain to)")
        if self.ssl_certfile is not None:
            try:
                ssl_context(self)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"cannot load the TLS certificate and key: {e}") from None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    @property
    def url(self) -> str:
        """The base URL the server listens on (`http://0.0.0.0:8000`: every interface)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def uvicorn_ssl_kwargs(self) -> dict:
        """uvicorn.Config's TLS arguments (empty without TLS)."""
        if self.ssl_certfile is None:
            return {}
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile,
                "ssl_ca_certs": self.ssl_ca_certs, "ssl_cert_reqs": self.ssl_cert_reqs}


def ssl_context(config: ServerConfig) -> ssl.SSLContext:
    """The server's TLS context as uvicorn builds it from the same arguments (TLS 1.2 or newer)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    ctx.verify_mode = ssl.VerifyMode(config.ssl_cert_reqs)
    if config.ssl_ca_certs:
        ctx.load_verify_locations(config.ssl_ca_certs)
    return ctx


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=ServerConfig.host,
                       help=f"address to listen on (default: {ServerConfig.host}, every interface)")
    group.add_argument("--port", type=int, default=ServerConfig.port,
                       help=f"TCP port to listen on (default: {ServerConfig.port})")
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on the API routes; /health, /ready, "
                            "/metrics, /version and /get_load stay open for probes (default: no key)")
    group.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model id clients use (default: MODEL, or minimax-m3-tiny)")
    group.add_argument("--chat-template", default=None, metavar="PATH",
                       help="path of a jinja chat template file (default: the checkpoint's template)")
    group.add_argument("--default-chat-template-kwargs", type=_json_object, default={}, metavar="JSON",
                       help='JSON object merged under each request\'s chat_template_kwargs, '
                            'e.g. \'{"thinking_mode": "disabled"}\' or \'{"reasoning_effort": "high"}\' '
                            '(default: none)')
    group.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="minimax_m3: return the model's thinking as reasoning_content (default: none)")
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="minimax_m3: return the model's tool calls as tool_calls (default: none)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide when to call tools (tool_choice auto; needs --tool-call-parser)")
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="BYTES",
                       help=f"larger request bodies are refused with 413 (default: {DEFAULT_MAX_REQUEST_BODY_BYTES})")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug", "trace"),
                       help="uvicorn's access and error log level (default: info)")
    group.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None,
                       help="m3serve's logging level (default info); debug adds tracebacks to errors")
    group.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                       help="tokens per streamed chunk: a chunk is sent once this many new tokens are "
                            "ready (and at the end; default: 1)")
    group.add_argument("--enable-response-store", action="store_true",
                       help="/v1/responses: keep responses in a bounded in-memory store so that "
                            "previous_response_id works (vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1)")
    group.add_argument("--responses-signing-key", default=None, metavar="KEY",
                       help="/v1/responses: the key that signs reasoning returned as encrypted_content; "
                            "give every replica behind a router the same key (default: a random key per "
                            "process, so blobs do not survive a restart)")
    compat = parser.add_argument_group(
        "accepted from vLLM command lines, not applicable to m3serve (each one given is logged)")
    for flag, why in NOT_APPLICABLE_FLAGS.items():
        name = flag.lstrip("-").replace("-", "_")
        if flag in _VALUED_FLAGS:
            compat.add_argument(flag, dest=f"compat_{name}", default=None, metavar="VALUE", help=why)
        elif flag == "--enable-chunked-prefill":
            compat.add_argument(flag, dest=f"compat_{name}", action=argparse.BooleanOptionalAction,
                                default=None, help=why)
        else:
            compat.add_argument(flag, dest=f"compat_{name}", action="store_true", default=None, help=why)
    group.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="images / videos may be file:// URLs under this directory (default: none)")
    group.add_argument("--allowed-media-domains", default=None, metavar="HOSTS",
                       help="comma-separated hosts http(s) image / video URLs may name (default: any "
                            "host at a public address)")
    group.add_argument("--allow-private-media-addresses", action="store_true",
                       help="let http(s) image / video URLs reach hosts at loopback, private, link-local "
                            "and other non-public addresses (default: refused, so that a request cannot "
                            "make the server connect into its own network); pair it with "
                            "--allowed-media-domains")
    group.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
                       help=f"images and video frames wider x higher than N pixels are refused from their "
                            f"header, before decoding (default {DEFAULT_MAX_IMAGE_PIXELS})")
    group.add_argument("--max-video-decoded-bytes", type=int, default=DEFAULT_MAX_VIDEO_DECODED_BYTES,
                       metavar="N", help=f"a video whose sampled frames decode to more than N bytes of RGB is "
                                         f"refused (default {DEFAULT_MAX_VIDEO_DECODED_BYTES})")
    group.add_argument("--max-video-total-frames", type=int, default=4096, metavar="N",
                       help="a video file of more than N frames is refused (default 4096)")
    group.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="TLS: the server's private key (PEM)")
    group.add_argument("--ssl-certfile", default=None, metavar="PATH",
                       help="TLS: the server's certificate chain (PEM); with --ssl-keyfile the server speaks HTTPS")
    group.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                       help="TLS: CA certificates (PEM) that client certificates must chain to")
    group.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=(0, 1, 2),
                       help="TLS: whether a client certificate is required: 0 no (default), 1 optional, "
                            "2 required (Python's ssl.CERT_* values)")
    group.add_argument("--metric-names", choices=METRIC_NAMES, default="both",
                       help="/metrics names: m3serve:*, vLLM's vllm:* (for dashboards and alerts built "
                            "for vLLM), or both (default)")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="serve no /docs, /redoc and /openapi.json (with --api-key they need the key)")
    group.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float, default=25.0, metavar="SECONDS",
                       help="seconds running requests may take to finish after SIGTERM/SIGINT before "
                            "they are aborted (default 25: inside Kubernetes' 30 s grace period)")
    group.add_argument("--engine-ready-timeout", dest="engine_ready_timeout_s", type=float, default=900.0,
                       metavar="SECONDS", help="seconds to wait for the engine to load the model (default: 900)")


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
        chat_template=args.chat_template, default_chat_template_kwargs=args.default_chat_template_kwargs,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        max_request_body_bytes=args.max_request_body_bytes, uvicorn_log_level=args.uvicorn_log_level,
        engine_ready_timeout_s=args.engine_ready_timeout_s, shutdown_timeout_s=args.shutdown_timeout_s,
        disable_fastapi_docs=args.disable_fastapi_docs, metric_names=args.metric_names,
        stream_interval=args.stream_interval, enable_response_store=args.enable_response_store,
        responses_signing_key=args.responses_signing_key,
        allowed_local_media_path=args.allowed_local_media_path, allowed_media_domains=args.allowed_media_domains,
        allow_private_media_addresses=args.allow_private_media_addresses, max_image_pixels=args.max_image_pixels,
        max_video_decoded_bytes=args.max_video_decoded_bytes, max_video_total_frames=args.max_video_total_frames,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs)


def not_applicable_given(args: argparse.Namespace) -> list[str]:
    """The vLLM flags of NOT_APPLICABLE_FLAGS this command line gave, each with why."""
    out = []
    for flag, why in NOT_APPLICABLE_FLAGS.items():
        value = getattr(args, "compat_" + flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            out.append(f"{flag}{'' if value is True else ' ' + str(value)}: {why}")
    return out
