"""The private Redis of `kvfleet up`: AOF in a data directory, a random password, 127.0.0.1 only; started
again on the same port and data when it dies.

- Data directory (`--data-dir`): by default `$XDG_DATA_HOME/kvfleet/redis-<gateway port>` (that is
  ~/.local/share/kvfleet/redis-8000): per user and mode 0700 (prompts live in the AOF), outside any working
  tree (never committed), kept across reboots (unlike /tmp), and one per gateway port, so two fleets on one
  machine never share an AOF. `kvfleet up` started again on the same directory resumes the queued work.
- Password: `secrets.token_hex`, new on each `kvfleet up`. It reaches redis-server through a 0600 config file
  and the children through KVFLEET_REDIS_URL in their environment, never argv (`ps` shows argv to every local
  user). The full URL is in `<data dir>/redis-url` (0600) while the fleet runs, for `kvfleet status` / `top`.
"""

from __future__ import annotations

import os
import secrets

from services.redis_server import RedisServer, write_private
from services.supervisor import ChildRestarts, exit_reason
from shared.settings import foreign_var, redacted_url

URL_FILE = "redis-url"
DEFAULT_MAXMEMORY = "1gb"
LOG_LINES = 5  # of redis.log, printed with the reason it ended


def default_data_dir(gateway_port: int) -> str:
    base = foreign_var("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "kvfleet", f"redis-{gateway_port}")


def url_file(server: RedisServer) -> str:
    return os.path.join(server.data_dir or "", URL_FILE)


def start(data_dir: str, maxmemory: str) -> RedisServer:
    server = RedisServer(password=secrets.token_hex(24), data_dir=data_dir, maxmemory=maxmemory).start()
    write_private(url_file(server), server.url + "\n")
    return server


def describe(server: RedisServer) -> str:
    """Where it is, safe to print, and how to get the full URL."""
    path = url_file(server)
    return (f"private Redis at {redacted_url(server.url)} (pid {server.proc.pid}), AOF in {server.data_dir}; "
            f"its full URL is in {path}: kvfleet status --redis-url \"$(cat {path})\"")


def stop(server: RedisServer) -> None:
    server.stop()
    try:
        os.remove(url_file(server))  # its password is no use once it stopped
    except FileNotFoundError:
        pass


def keep(server: RedisServer, record: ChildRestarts, say) -> bool:
    """Call often: notes the exit of the private Redis and starts it again when due (same port, same data, same
    password, so the clients reconnect as they were). False when it cannot be kept: the fleet stops."""
    if server.proc is not None and server.proc.poll() is None:
        return True
    if server.proc is not None:  # it just exited
        pid, code = server.proc.pid, server.proc.returncode
        reason = exit_reason(code, server.log_tail().splitlines()[-LOG_LINES:])
        server.proc = None
        delay = record.exited()
        if delay is None:
            say(f"the private Redis (pid {pid}) {reason}, {record.recent_restarts()} times within "
                f"{record.policy.window_s:g}s of its restarts; stopping the fleet. Find the cause (memory? a "
                "signal from outside?), or give a Redis you run yourself with --redis-url.", err=True)
            return False
        say(f"the private Redis (pid {pid}) {reason}; starting it again on port {server.port} in {delay:g}s with "
            f"its AOF in {server.data_dir} (queued requests are kept)", err=True)
    if not record.due():
        return True
    port = server.port
    server.stop()  # the data dir stays
    server.port = port
    try:
        server.start()
    except RuntimeError as e:
        say(f"cannot start the private Redis again: {e}; stopping the fleet", err=True)
        return False
    if server.port != port:
        server.stop()
        say(f"port {port} of the private Redis was taken meanwhile, and its clients know only that port; "
            "stopping the fleet", err=True)
        return False
    record.started()
    say(f"private Redis running again at {redacted_url(server.url)} (pid {server.proc.pid})")
    return True
