"""What the fleet's Redis did for a `kvfleet bench serve` run (`--redis-stats URL`): commands, bytes and CPU per
generated token, from INFO before and after the run (issue #17's measure). The counters are the server's, so
anything else using that Redis in the meantime is counted too: run it on a Redis of its own."""

from __future__ import annotations

from typing import Any

from shared import streams

TOP = 8  # commands listed by their count per token


class RedisWatch:
    """`with RedisWatch(url) as w:` around a run; then `w.report(output_tokens)`."""

    def __init__(self, url: str):
        self.r = streams.connect(url)
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}

    def __enter__(self) -> RedisWatch:
        self.before = streams.work_counters(self.r)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.after = streams.work_counters(self.r)
        self.r.close()

    def report(self, tokens: int) -> dict[str, Any] | None:
        if not self.after or tokens <= 0:
            return None
        d = {k: v - self.before.get(k, 0) for k, v in self.after.items()}
        top = sorted(((k.removeprefix("calls:"), v / tokens) for k, v in d.items() if k.startswith("calls:") and v),
                     key=lambda kv: -kv[1])[:TOP]
        return {"commands_per_token": d["commands"] / tokens, "bytes_per_token": d["net_bytes"] / tokens,
                "usec_sum_per_token": d["usec"] / tokens, "cpu_us_per_token": d["cpu_s"] * 1e6 / tokens,
                "commands_by_name_per_token": dict(top),
                "cpu_s_per_master": [d[k] for k in sorted(d) if k.startswith("cpu_s:")]}  # a cluster's


def describe(redis: dict[str, Any]) -> str:
    """One line for the table."""
    top = ", ".join(f"{k} {v:.3f}" for k, v in redis["commands_by_name_per_token"].items())
    return (f"{redis['commands_per_token']:.3f} commands, {redis['bytes_per_token']:.0f} bytes, "
            f"{redis['cpu_us_per_token']:.1f} us of Redis CPU ({redis['usec_sum_per_token']:.1f} us by commandstats) "
            f"per output token; {top}"
            + (f"; Redis CPU per master {' / '.join(f'{c:.2f}' for c in masters)} s" if (masters := redis.get(
                "cpu_s_per_master")) else ""))
