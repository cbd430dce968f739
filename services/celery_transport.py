"""The Celery broker transport: kombu's Redis transport, made to survive a lost connection while a task runs.

With acks_late, a task in progress is an unacked message. When the broker connection drops (Redis restarted,
CLIENT KILL), the Celery worker collects the broken connection (which drops the transport's client) and then
closes it; closing the channel restores the unacked message, which builds a new connection pool from the
client that is gone: AttributeError ('NoneType' object has no attribute 'hostname'), "Unrecoverable error",
and the worker exits (kombu 5.7, celery 5.7). Here that pool is refused with a ConnectionError instead, which
the close ignores: the worker reconnects, the running task finishes and stores its result, and its message,
still in the unacked set, comes back after the visibility timeout, when the job record returns the stored
result. `broker_transport` in services.celery_app names this class."""

from __future__ import annotations

from typing import Any

from kombu.transport import redis


class Channel(redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None:
            raise ConnectionError("the broker connection was closed after it was lost; the worker reconnects")
        return super()._connparams(asynchronous=asynchronous)


class Transport(redis.Transport):
    Channel = Channel
