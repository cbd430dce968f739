"""Settings of the backend-facing services (Celery app, Python client, batch files): kvfleet's Settings plus
the Celery broker, redelivery and retry knobs and the lifetime of job records.

They are read by shared.settings like every other setting (KVFLEET_<FIELD>, e.g. KVFLEET_CELERY_BROKER_URL,
KVFLEET_CELERY_VISIBILITY_TIMEOUT_S); nothing here touches the environment itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.settings import Settings


@dataclass(frozen=True)
class BackendSettings(Settings):
    celery_broker_url: str = field(default="", repr=False)  # "" = redis_url (the fleet's Redis)
    celery_result_backend: str = field(default="", repr=False)  # "" = the broker URL
    # A task a Celery worker took but never acked (the worker died) is redelivered after this long. Keep it
    # above the longest generation: a task still running past it is delivered again (harmless: it attaches).
    celery_visibility_timeout_s: float = 3600.0
    celery_max_retries: int = 10  # retries of a task the fleet cannot take now (429 / 503), with backoff
    celery_retry_backoff_max_s: int = 60
    job_ttl_s: float = 86400.0  # how long a request id's job record (and its finished result) is kept
    # An attempt that held a request id's placing lease this long died while placing: the next one takes over.
    job_lease_s: float = 10.0

    @property
    def broker_url(self) -> str:
        return self.celery_broker_url or self.redis_url

    @property
    def result_backend(self) -> str:
        return self.celery_result_backend or self.broker_url
