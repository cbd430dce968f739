"""The pieces of services/ that need no Redis: errors (and their Celery round trip), parameter checks, the
backend settings and the Celery app's delivery configuration."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.chat_api import ChatCompletionRequest
from gateway.errors import APIError
from gateway.openai_api import CompletionRequest
from services.call_errors import (
    FleetUnavailable,
    GenerationFailed,
    InvalidRequest,
    from_api_error,
    from_validation_error,
)
from services.fleet_calls import check_params
from shared.settings import Settings

pytestmark = pytest.mark.unit


def test_validation_errors_name_the_field_and_the_value():
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "top_p": 1.5})
    err = from_validation_error(exc.value)
    assert isinstance(err, InvalidRequest) and err.param == "top_p" and err.status_code == 400
    assert str(err).startswith("top_p: ") and "1.5" in str(err)
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({"model": "m"})
    assert from_validation_error(exc.value).param == "messages"


@pytest.mark.parametrize(("status", "cls"), [(400, InvalidRequest), (404, InvalidRequest), (429, FleetUnavailable),
                                             (503, FleetUnavailable), (500, GenerationFailed),
                                             (504, GenerationFailed)])
def test_gateway_statuses_map_to_call_errors(status, cls):
    err = from_api_error(APIError(status, "why", param="p", code="c"))
    assert type(err) is cls and (err.message, err.status_code, err.param, err.code) == ("why", status, "p", "c")


def test_call_errors_survive_celerys_json_round_trip():
    """Celery's JSON backend stores type, module and args, and rebuilds the error as cls(*args)."""
    err = InvalidRequest("n: must be >= 1", 400, "n", "invalid_value")
    again = type(err)(*err.args)
    assert (str(again), again.param, again.code, again.body()) == (str(err), "n", "invalid_value", err.body())
    assert FleetUnavailable("full").status_code == 429 and isinstance(err, ValueError)


def test_check_params_refuses_unknown_names_and_streaming():
    check_params(CompletionRequest, {"prompt": "x", "max_tokens": 3, "stream": False})
    with pytest.raises(InvalidRequest) as exc:
        check_params(CompletionRequest, {"prompt": "x", "max_token": 3})
    assert exc.value.param == "max_token" and "unknown parameter" in str(exc.value)
    with pytest.raises(InvalidRequest) as exc:
        check_params(ChatCompletionRequest, {"messages": [], "stream": True})
    assert exc.value.param == "stream"


def test_backend_settings_read_through_shared_settings():
    s = Settings.from_env(env={"KVFLEET_REDIS_URL": "redis://:pw@h:1/0",
                                      "KVFLEET_CELERY_VISIBILITY_TIMEOUT_S": "2.5",
                                      "KVFLEET_CELERY_MAX_RETRIES": "3"})
    assert s.broker_url == s.result_backend == "redis://:pw@h:1/0"
    assert (s.celery_visibility_timeout_s, s.celery_max_retries) == (2.5, 3)
    s = Settings.from_env(env={"KVFLEET_CELERY_BROKER_URL": "redis://h:1/1"}, redis_url="redis://h:1/0")
    assert (s.redis_url, s.broker_url, s.result_backend) == ("redis://h:1/0", "redis://h:1/1", "redis://h:1/1")
    assert "pw" not in repr(Settings(celery_broker_url="redis://:pw@h/0"))


def test_celery_app_acks_late_and_retries_a_full_fleet_not_a_bad_request():
    from celery import Celery

    from services.celery_app import chat, configure, generate

    app = Celery("t")
    configure(app, Settings(redis_url="redis://h:1/0", celery_visibility_timeout_s=2))
    conf = app.conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == 2
    assert conf.broker_transport_options["unacked_restore_interval"] == 1
    for task in (generate, chat):
        assert task.acks_late and task.reject_on_worker_lost
        assert FleetUnavailable in task.autoretry_for and InvalidRequest not in task.autoretry_for
        assert task.retry_backoff and task.throws == (InvalidRequest,)
    assert (generate.name, chat.name) == ("kvfleet.generate", "kvfleet.chat")


@pytest.mark.parametrize(("pool", "traced"), [("threads", True), ("solo", True), ("prefork", False),
                                              ("processes", False)])
def test_the_celery_worker_sets_up_tracing_where_its_tasks_run(monkeypatch, pool, traced):
    """worker_init sets tracing up in the main process unless prefork children run the tasks, which do it on
    worker_process_init (an exporter's thread does not survive a fork)."""
    from types import SimpleNamespace

    from services import celery_app
    from shared import telemetry

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    try:
        celery_app._trace_worker(sender=SimpleNamespace(pool_cls=pool))
        assert telemetry.enabled() is traced
        celery_app._trace_pool_process()
        assert telemetry.enabled()
    finally:
        celery_app._flush_traces()
    assert not telemetry.enabled()
