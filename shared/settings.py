"""Settings: the only module that reads the environment. One dataclass, passed down.

Every field has a KVFLEET_* variable (the field name upper-cased, e.g. KVFLEET_QUEUE_BOUND); command-line
flags override them through `Settings.from_env(**overrides)`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, fields, replace
from typing import Any

from shared import keys

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MODEL = "smollm2"
ENV_PREFIX = "KVFLEET_"
URL_FIELDS = ("celery_broker_url", "celery_result_backend")  # besides redis_url: may hold passwords


def _default_worker_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host}-{os.getpid()}"


@dataclass(frozen=True, repr=False)
class Settings:
    redis_url: str = DEFAULT_REDIS_URL
    model: str = DEFAULT_MODEL
    api_keys: tuple[str, ...] = ()  # never printed (see __repr__)
    worker_id: str = field(default_factory=_default_worker_id)
    routing: str = "free_blocks"
    # Requests that no worker fits go to the shared stream; past this many waiting there, answer 429.
    queue_bound: int = 1024
    # Every routing policy: a worker with this many requests waiting (enqueued there and not yet counted by its
    # status, plus taken and not yet running) gets no more; the request goes elsewhere, or to the shared stream
    # (then 429).
    worker_queue_bound: int = 64
    # A request body larger than this gets 413 before it is parsed or its API key checked.
    max_body_bytes: int = 4 * 1024 * 1024
    tokenizer_threads: int = 4  # the gateway tokenizes inputs over 2 KiB in this many threads, off its event loop
    retry_after_s: int = 1
    # A worker's status lives this long unless refreshed; heartbeats come every heartbeat_s.
    status_ttl_s: float = 5.0
    heartbeat_s: float = 1.0
    # A worker whose main loop has not come round for this long is hung (an engine step that never returns): it
    # logs where, removes its status (the others take its requests over) and exits 1; /livez fails past it too.
    # Above the longest step the worker can take (a 2,048-token prefill of a large model on a few CPU cores
    # takes minutes). 0: never.
    engine_stall_s: float = 300.0
    status_max_hz: float = 20.0
    # free_blocks routing keeps this many blocks free on every worker for the requests it already runs.
    reserve_blocks: int = 2
    # Routing counts a request's output at most this many tokens (the scheduler preempts past that).
    route_max_output_tokens: int = 512
    # prefix routing's cost: prefix_weight * (prompt blocks not cached on the worker) + blocks in use there; only
    # workers with at most prefix_affinity_slack requests (running + waiting) more than the least loaded compete
    # (negative: no bound). Chosen with `kvfleet bench fleet-sim` (services/bench/FIGURES.md, "Routing: the prefix
    # policy").
    prefix_weight: float = 16.0
    prefix_affinity_slack: int = 32
    reservation_ttl_s: float = 30.0
    max_deliveries: int = 3
    output_ttl_s: float = 3600.0  # output streams nobody reads expire after this
    output_ttl_after_read_s: float = 120.0  # ... and this long after a gateway read the final chunk
    request_timeout_s: float = 600.0  # no chunk for this long: the gateway cancels and answers 504
    # A stream being relayed pauses this long while Redis is unreachable and then goes on where it stopped;
    # past it the request ends with an error (an SSE error event and [DONE], or a 503), never silently.
    redis_grace_s: float = 15.0
    # A gateway holds a lease (this TTL, refreshed every third of it) on each request while its client is
    # connected; a worker aborts a request whose lease lapsed (the gateway died) within about this + 3 s.
    lease_ttl_s: float = 10.0
    # Redis connections one gateway opens at most: each stream it relays holds one during its blocking read;
    # past this many, a read waits for a free one (up to 30 s). Keep it under Redis's maxclients.
    redis_max_connections: int = 1024
    # Shards of the fleet's keys (shared.keys): on Redis Cluster, about 4 per master spreads the load; each worker
    # lives in one (the trailing number of its id, modulo this). Every worker of a fleet needs the same value;
    # change it only with the fleet drained. 1: one Redis.
    redis_shards: int = 1
    # A gateway reads the fleet (every worker's status and reservations) at most this often, one read shared by
    # the requests it places meanwhile (workers publish at most 20 times a second); 0: a read per request.
    fleet_view_max_age_s: float = 0.05
    queue_when_no_workers: bool = False  # scale-to-zero: queue in the shared stream instead of 503
    # A CPU worker makes its whole KV cache resident in the background after it starts (first-touch page
    # faults then never land in a forward); 0: pages fault in on first use (memory grows only as it is used).
    kv_prefault: bool = True
    # The -march kvfleet's native CPU kernels are compiled for: "native" (this CPU's every extension), or a GCC
    # name such as x86-64-v3 (AVX2 + FMA, as a Zen 3) or x86-64 (no AVX), to run the code paths of an older CPU
    # here. One whose extensions this CPU lacks is refused (its code would stop the process with SIGILL).
    cpu_march: str = "native"
    # tool_choice "auto" (the default with tools): the gateway reads the model's calls out of its text with this
    # parser (gateway.tool_parsers: hermes, mistral, llama3_json), as vLLM's --enable-auto-tool-choice
    # --tool-call-parser; off, such a request is a 400.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str = ""
    # The chat template the gateway applies in place of the model's own: a file, a Jinja text, or a template
    # kvfleet ships (gateway/chat_templates: "chatml-tools" shows tools to ChatML models such as SmolLM2).
    chat_template: str = ""
    metrics_host: str = "127.0.0.1"  # where a worker serves /livez, /readyz, /metrics (0.0.0.0 in pods)
    # With api_keys set, the gateway's /metrics needs the key like every route; this opens /metrics alone, for
    # scrapers that cannot send one (Prometheus by pod annotations). /docs, /openapi.json, /v1/fleet stay closed.
    metrics_open: bool = False
    restarts: int = 0  # times `kvfleet up` started this process again after it exited (a worker publishes it)
    # ---- backend services (Celery app, Python client, batch files) ----
    celery_broker_url: str = ""  # "" = redis_url (the fleet's Redis)
    celery_result_backend: str = ""  # "" = the broker URL
    # A task a Celery worker took but never acked (the worker died) is redelivered after this long. Keep it
    # above the longest generation: a task still running past it is delivered again (harmless: it attaches).
    celery_visibility_timeout_s: float = 3600.0
    celery_max_retries: int = 10  # retries of a task the fleet cannot take now (429 / 503), with backoff
    celery_retry_backoff_max_s: int = 60
    job_ttl_s: float = 86400.0  # how long a request id's job record (and its finished result) is kept
    # An attempt that held a request id's placing lease this long died while placing: the next one takes over.
    job_lease_s: float = 10.0

    @property
    def worker_shard(self) -> int:
        """The shard this worker (worker_id) lives in."""
        return keys.shard_of(self.worker_id, self.redis_shards)

    @property
    def broker_url(self) -> str:
        return self.celery_broker_url or self.redis_url

    @property
    def result_backend(self) -> str:
        return self.celery_result_backend or self.broker_url

    def __repr__(self) -> str:
        """Safe to log: Redis passwords (fleet, broker, result backend) redacted, API keys only counted."""
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("redis_url", "api_keys")}
        for name in URL_FIELDS:
            shown[name] = redacted_url(shown[name])
        body = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        return (f"Settings(redis_url={redacted_url(self.redis_url)!r}, api_keys=<{len(self.api_keys)}>, "
                f"{body})")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        """Defaults <- KVFLEET_* environment <- non-None `overrides` (command-line flags)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(f.name, f.type, raw)
        settings = cls(**values)
        return settings.with_overrides(**overrides)

    def with_overrides(self, **overrides: Any) -> Settings:
        clean = {k: v for k, v in overrides.items() if v is not None and not (k == "api_keys" and not v)}
        if "api_keys" in clean:
            clean["api_keys"] = tuple(clean["api_keys"])
        return replace(self, **clean)


def _parse(name: str, type_name: Any, raw: str) -> Any:
    type_name = str(type_name)
    try:
        if type_name.startswith("tuple"):
            return tuple(s.strip() for s in raw.split(",") if s.strip())
        if type_name == "bool":
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {type_name}") from None
    return raw


def hf_offline() -> None:
    """kvfleet never downloads from a hub: make every transformers call offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def child_env(**overrides: str) -> dict[str, str]:
    """The environment of a child process kvfleet starts (a worker, a gateway, a baseline): this process's,
    with `overrides` on top."""
    return {**os.environ, **overrides}


def is_set(field_name: str) -> bool:
    """Is KVFLEET_<FIELD> set (non-empty) in the environment, as opposed to taking the default?"""
    return bool(os.environ.get(ENV_PREFIX + field_name.upper()))


def foreign_var(name: str, default: str = "") -> str:
    """A variable that another tool owns (CXX, TRITON_INTERPRET, VLLM_CPU_OMP_THREADS_BIND), read here like
    every other."""
    return os.environ.get(name, default)


def redacted_url(url: str) -> str:
    """A Redis URL safe to print: the password replaced by ***."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0] if ":" in creds else ""
    return f"{scheme}://{user}:***@{host}"


def otel_traces_export(env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """(traces endpoint, protocol) from the standard OpenTelemetry variables; endpoint None: tracing is off.

    Only what decides whether to export at all is read here; the OTel SDK itself reads the rest
    (OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER(_ARG), OTEL_EXPORTER_OTLP_HEADERS, OTEL_BSP_*, ...)."""
    env = os.environ if env is None else env
    off = (env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
           or env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none")
    endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "").strip()
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
    return (None if off or not endpoint else endpoint), protocol
