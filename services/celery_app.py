"""The Celery app for backends that hand generation jobs to the fleet like any other job:
`celery -A services.celery_app worker` starts a worker; `generate.delay(prompt, max_tokens=64).get()` returns
the OpenAI-shaped completion as a plain dict.

Tasks (same parameters as the HTTP API, validated by the gateway's own models):
  kvfleet.generate(prompt, model=None, **params)    like POST /v1/completions
  kvfleet.chat(messages, model=None, **params)      like POST /v1/chat/completions
model=None: the model the fleet serves. Each task puts its request straight into the fleet's streams (routed
by free KV blocks, like the gateway) under the task id as request id, and waits for the output.

Delivery: acks_late and reject_on_worker_lost, so a task whose Celery worker dies is delivered again (after
KVFLEET_CELERY_VISIBILITY_TIMEOUT_S with the Redis broker); the job record for its request id makes the
second delivery attach to the first one's generation, or return its stored result, instead of generating
again. A full fleet (429), no live worker (503) or a lost Redis connection is retried with exponential
backoff; so is the wait for output when Redis stays away past KVFLEET_REDIS_GRACE_S or came back without the
request (streams.RedisAway / OutputLost are ConnectionErrors): the retry attaches, or places it again. A bad
request fails at once with InvalidRequest naming the field.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery, Task, signals

from services.call_errors import FleetUnavailable, InvalidRequest
from services.fleet_calls import FleetCaller
from services.loop_thread import LoopThread
from shared import streams, telemetry
from shared.settings import Settings, hf_offline, redacted_url

SETTINGS = Settings.from_env()


def configure(app: Celery, settings: Settings) -> None:
    """Broker and result backend on Redis (the fleet's, by default) and the delivery guarantees above. Celery's
    Redis transport (kombu) speaks to one server: a fleet on Redis Cluster needs a broker of its own."""
    for name, url in (("KVFLEET_CELERY_BROKER_URL", settings.broker_url),
                      ("KVFLEET_CELERY_RESULT_BACKEND", settings.result_backend)):
        if streams.cluster_url(url) is not None:
            raise ValueError(f"{name} is a Redis Cluster ({redacted_url(url)}): Celery's Redis broker and result "
                             f"backend need one server; set {name} to a plain redis:// URL (the fleet itself stays "
                             "on the cluster)")
    vt = settings.celery_visibility_timeout_s
    app.conf.update(
        broker_url=settings.broker_url,
        # kombu's Redis transport, made to survive a connection lost while a task runs (services.celery_transport)
        broker_transport="services.celery_transport:Transport" if settings.broker_url.startswith("redis://") else None,
        result_backend=settings.result_backend,
        task_serializer="json", result_serializer="json", accept_content=["json"],
        task_acks_late=True, task_reject_on_worker_lost=True, task_track_started=True,
        worker_prefetch_multiplier=1,
        result_expires=int(settings.job_ttl_s),
        broker_connection_retry_on_startup=True,
        # How soon a task left unacked by a dead worker goes back to the queue, and how often a worker looks.
        broker_transport_options={"visibility_timeout": vt, "unacked_restore_interval": max(1, min(10, int(vt / 4))),
                                  "unacked_restore_throttle": 1 if vt < 600 else 10},
        result_backend_transport_options={"visibility_timeout": vt},
        # A result that cannot be stored (Redis restarting) is retried for about a minute, with backoff, instead of
        # failing at once: a task that starts as the connection drops would otherwise fail "outside body" on its
        # STARTED state, never run, and wait out the visibility timeout. Clients' reads of results retry alike.
        result_backend_always_retry=True, result_backend_max_retries=120,
        result_backend_base_sleep_between_retries_ms=50, result_backend_max_sleep_between_retries_ms=1000,
    )


app = Celery("kvfleet")
configure(app, SETTINGS)


# Tracing (when an OTLP endpoint is set): each process that runs tasks sets it up once; each placement is then
# a root span (services.fleet_calls) that the fleet worker continues. Prefork children set it up after the
# fork (the exporter's thread does not survive one); the other pools run tasks in the main process.
@signals.worker_process_init.connect
def _trace_pool_process(**_: Any) -> None:
    telemetry.setup_tracing("kvfleet-celery")


@signals.worker_init.connect
def _trace_worker(sender: Any = None, **_: Any) -> None:
    from celery.concurrency import get_implementation

    if not get_implementation(getattr(sender, "pool_cls", "prefork")).__module__.endswith(".prefork"):
        telemetry.setup_tracing("kvfleet-celery")


@signals.worker_process_shutdown.connect
@signals.worker_shutdown.connect
def _flush_traces(**_: Any) -> None:
    telemetry.shutdown()


class _Runtime:
    """Per worker process: one event loop thread and one FleetCaller (its Redis client and the tokenizers,
    each tokenizer loaded once per process). Rebuilt in a forked child."""

    def __init__(self) -> None:
        self.loop = LoopThread("kvfleet-celery")
        self.caller: FleetCaller | None = None
        self.pid = os.getpid()

    def run(self, kind: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        return self.loop.run(self._call(kind, body, request_id))

    async def _call(self, kind: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        if self.caller is None or self.pid != os.getpid():
            hf_offline()
            self.pid = os.getpid()
            self.caller = FleetCaller(SETTINGS)
        return await self.caller.call(kind, body, request_id)


_runtime = _Runtime()

TASK_OPTIONS: dict[str, Any] = dict(
    bind=True, acks_late=True, reject_on_worker_lost=True,
    # a full fleet, no live worker, a Redis blip: retrying is safe, the job record makes it attach
    autoretry_for=(FleetUnavailable, *streams.CONNECTION_ERRORS), retry_backoff=True, retry_jitter=True,
    throws=(InvalidRequest,),  # the caller's mistake: logged without a traceback
    retry_backoff_max=SETTINGS.celery_retry_backoff_max_s, max_retries=SETTINGS.celery_max_retries,
)


@app.task(name="kvfleet.generate", **TASK_OPTIONS)
def generate(self: Task, prompt: Any, model: str | None = None, **params: Any) -> dict[str, Any]:
    """A text completion (POST /v1/completions parameters: max_tokens, temperature, top_p, stop, seed, ...).
    `prompt` may be a list of prompts: each is its own fleet request (`{task id}-{i}`), answered as one body."""
    return _runtime.run("completion", {"prompt": prompt, "model": model, **params}, self.request.id)


@app.task(name="kvfleet.chat", **TASK_OPTIONS)
def chat(self: Task, messages: list[dict[str, Any]], model: str | None = None, **params: Any) -> dict[str, Any]:
    """A chat completion (POST /v1/chat/completions parameters); messages like [{"role": "user", "content": ...}]."""
    return _runtime.run("chat", {"messages": messages, "model": model, **params}, self.request.id)
