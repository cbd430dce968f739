"""Every Redis command kvfleet sends lives in this package, as a named operation; no other module imports
redis (tests/unit/test_layering.py keeps it so). Callers use the names below (`streams.aread_fleet(r)`,
`streams.publish(r, ...)`) and catch RedisError / CONNECTION_ERRORS from here.

  client    connect / connect_async, the Lua-script runner (each atomic step is one LuaScript), error types
  multiplexed  one pipelined connection for a hot path (the gateway's per-request commands): a tenth of
            redis-py's CPU per command
  requests  enqueue (routed with its reservation, or the bounded shared stream) and cancels
  output    numbered output chunks: written by workers, read back once each by gateways and services
  fleet     live workers, reservations and the snapshot; the round-robin turn; the prefix index
  leases    a gateway's leases on the requests it relays (held while its client waits), read by workers
  jobs      job records: a request id placed by services enters the fleet at most once
  worker    a worker's intake (group reads, takeover, forwards, dead letters, cancels) and its leaving
  flush     a worker's outbox: one fenced script a flush (chunks, hand-backs, acks, status)
  key_types keys of another Redis type in kvfleet's names (another program's write): found, named, worked around
  admin     the server itself: drop client connections, memory used (for `kvfleet chaos`)

Key names come from shared.keys; messages are shared.messages' pydantic models, as JSON in one field.
"""

from shared.streams.admin import (  # noqa: F401
    CLUSTER_SLOTS,
    assign_slots,
    cluster_problem,
    kill_clients,
    meet,
    plant_foreign_state,
    used_memory,
    work_counters,
)
from shared.streams.client import (  # noqa: F401
    CANNOT_PERSIST,
    CONNECTION_ERRORS,
    FULL,
    AuthenticationError,
    Client,
    LuaScript,
    RedisError,
    arun_script,
    cannot_persist,
    cluster_url,
    connect,
    connect_async,
    group_missing,
    out_of_memory,
    run_script,
    write_refused,
    wrong_type,
)
from shared.streams.fleet import (  # noqa: F401
    PREFIX_OWNERS,
    PREFIX_TTL_S,
    afleet_snapshot,
    anext_turn,
    aping,
    aprefix_owners,
    aread_fleet,
    aread_shards,
    aremember_prefix,
)
from shared.streams.flush import keep_status, publish  # noqa: F401
from shared.streams.jobs import (  # noqa: F401
    JOB_SCAN_PAGE,
    aclaim_job,
    afinish_job,
    aget_job,
    areplace_job,
    arequest_in_fleet,
)
from shared.streams.key_types import (  # noqa: F401
    RECHECK_S,
    Avoided,
    KeyOfAnotherType,
    afind,
    afind_in_fleet,
    araise_named,
    find,
    report,
)
from shared.streams.leases import ahold_leases, leases_alive  # noqa: F401
from shared.streams.multiplexed import Multiplexed, multiplexed  # noqa: F401
from shared.streams.output import (  # noqa: F401
    ChunkDeduper,
    OutputLost,
    OutputTimeout,
    RedisAway,
    RedisOutage,
    acreate_inbox,
    add_chunk_commands,
    adelete_inbox,
    aentries_exist,
    aentry_exists,
    aiter_output,
    akeep_inbox,
    aoutput_exists,
    aread_inbox,
    arestore_output,
    iter_output,
    output_exists,
    read_all_chunks,
)
from shared.streams.requests import (  # noqa: F401
    CANCEL_MARK_TTL_S,
    CANCEL_STREAM_MAXLEN,
    ENQUEUE_MARK_TTL_S,
    acancel,
    aenqueue,
    aenqueue_routed,
    aenqueue_shared,
    cancel,
    cancel_commands,
    enqueue,
    enqueue_commands,
    parse_request,
)
from shared.streams.shard_members import (  # noqa: F401
    leave,
    other_workers,
    pending_owners,
    prune_dead_worker,
    register_shard,
    request_streams,
    shard_workers,
)
from shared.streams.worker import (  # noqa: F401
    DEAD_LETTER_MAXLEN,
    Ack,
    Delivery,
    ack_and_delete,
    ack_commands,
    cancel_cursor,
    claim_pending,
    dead_letter,
    ensure_group,
    forward,
    is_cancelled,
    read_cancels,
    read_requests,
    reclaim_own,
    release_reservation,
    shared_heads,
)
