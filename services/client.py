"""The Python client, for code that neither speaks HTTP nor uses Celery: it puts requests straight into the
fleet's Redis streams (routed by free KV blocks, exactly as the gateway does) and reads their output back.

    with FleetClient("redis://127.0.0.1:6379/0") as client:
        handle = client.submit("Once upon a time", max_tokens=32)          # or messages=[...] for chat
        print(handle.result(timeout=60)["choices"][0]["text"])

        async for chunk in client.submit("Tell me", max_tokens=64):      # streamed OutputChunks, each once
            print(chunk.text, end="")

        handle.cancel()                                                    # the worker aborts it

Parameters are the HTTP API's (max_tokens, temperature, top_p, stop, seed, n, logprobs, priority, ...).
submit() raises InvalidRequest (bad field, named) or FleetUnavailable (429 / 503: retry later); result()
raises GenerationFailed when the fleet fails the request. Reading output rides out a Redis outage of up to
KVFLEET_REDIS_GRACE_S and goes on where it stopped; past it, or when Redis came back without the request,
it raises streams.RedisAway / streams.OutputLost (both ConnectionErrors, in streams.CONNECTION_ERRORS). Pass request_id= to make a resubmission attach to
the request already in the fleet instead of generating it again; the same id with another request raises
InvalidRequest (409, code request_id_conflict). A request placed here holds no lease (unlike the gateway's):
it is a job that runs to the end even when this process dies or stops reading; cancel() stops it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from gateway.prompts import prompt_count
from services.call_errors import InvalidRequest
from services.fleet_calls import Call, FleetCaller
from services.loop_thread import LoopThread
from shared import streams
from shared.messages import OutputChunk
from shared.settings import Settings, hf_offline


class FleetClient:
    def __init__(self, redis_url: str | None = None, *, settings: Settings | None = None,
                 submit_timeout_s: float = 60.0):
        hf_offline()
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        self.submit_timeout_s = submit_timeout_s
        self._loop = LoopThread("kvfleet-client")
        self._caller = FleetCaller(self.settings)
        self._redis = streams.connect(self.settings.redis_url)

    def submit(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
               request_id: str | None = None, **params: Any) -> Handle:
        """A completion (`prompt`) or a chat completion (`messages`) into the fleet; returns at once."""
        if (prompt is None) == (messages is None):
            raise InvalidRequest("pass either prompt (a completion) or messages (a chat completion)", 400,
                                 "prompt", "invalid_value")
        if prompt_count(prompt) > 1:
            raise InvalidRequest(f"prompt: a handle follows one request; submit each of the {len(prompt)} prompts on "
                                 "its own", 400, "prompt", "invalid_value")
        kind, body = ("chat", {"messages": messages}) if messages is not None else ("completion", {"prompt": prompt})
        call = self._loop.run(self._caller.submit(kind, body | params, request_id), self.submit_timeout_s)
        return Handle(self, call)

    def close(self) -> None:
        try:
            self._loop.run(self._caller.aclose(), 10)
        finally:
            self._loop.close()
            self._redis.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Handle:
    """One request in the fleet. `result()` can follow iteration (it reads the output again from the start)."""

    def __init__(self, client: FleetClient, call: Call):
        self._client, self._call = client, call

    @property
    def request_id(self) -> str:
        return self._call.request_id

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The whole response body (OpenAI's shape); TimeoutError after `timeout` s (the request keeps running:
        call again, or cancel())."""
        return self._client._loop.run(self._client._caller.result(self._call), timeout)

    def cancel(self) -> None:
        """Ask the fleet to stop it: the worker aborts it and frees its KV blocks; its last chunk (and the
        result) then says finish_reason "abort"."""
        streams.cancel(self._client._redis, self.request_id)

    def _gone(self, exists: bool) -> bool:
        return self._call.result is not None and not exists  # finished long ago: only the result is left

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[OutputChunk]:
        s = self._client.settings
        r = streams.connect_async(s.redis_url)  # on the caller's event loop
        try:
            if self._gone(await streams.aoutput_exists(r, self.request_id, self._call.info.shard)):
                return
            async for chunk in streams.aiter_output(r, self.request_id, self._call.info.shard,
                                                    timeout_s=s.request_timeout_s, entry=self._call.info.entry,
                                                    expire_after_s=s.output_ttl_s, grace_s=s.redis_grace_s):
                yield chunk
        finally:
            await r.aclose()

    def __iter__(self) -> Iterator[OutputChunk]:
        """The same chunks for synchronous code."""
        s, r = self._client.settings, self._client._redis
        if self._gone(streams.output_exists(r, self.request_id, self._call.info.shard)):
            return iter(())
        return streams.iter_output(r, self.request_id, self._call.info.shard, timeout_s=s.request_timeout_s,
                                   expire_after_s=s.output_ttl_s, grace_s=s.redis_grace_s, entry=self._call.info.entry)
