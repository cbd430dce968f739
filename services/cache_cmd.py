"""`kvfleet cache`: what kvfleet keeps under ~/.cache/kvfleet (or --root): a GGUF's de-quantized float32 copy
(gguf/, ~540 MB for the default model) and the tokenizer read out of one (tokenizers/), each made once per
file content and reused by every worker and gateway; and the native CPU kernels built for this machine
(cpu_kernels/). Each entry's last use is the mtime of its directory (a worker or gateway that loads it
marks it).

    kvfleet cache                                   # each entry: kind, size, last used, name
    kvfleet cache prune --unused-for 7 [--dry-run]  # remove the model entries not used for 7 days

Prune removes only model entries (gguf/, tokenizers/), never one that a process is writing (its lock is
held); an entry removed is made again from its model file on next use.
"""

from __future__ import annotations

import argparse
import fcntl
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("gguf", "tokenizers", "cpu_kernels")
PRUNABLE = ("gguf", "tokenizers")
DAY_S = 86400.0


@dataclass(frozen=True)
class Entry:
    kind: str
    path: Path
    size: int  # bytes
    last_used: float  # epoch seconds

    @property
    def lock(self) -> Path:
        return self.path.parent / f"{self.path.name}.lock"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, default=Path.home() / ".cache" / "kvfleet", help="the cache's directory")
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    prune = sub.add_parser("prune", help="remove model entries not used for a while")
    prune.add_argument("--unused-for", type=float, required=True, metavar="DAYS",
                       help="remove the entries whose last use is older than this many days (0: every one not in use)")
    prune.add_argument("--dry-run", action="store_true", help="only say what would be removed")


def entries(root: Path) -> list[Entry]:
    """The cache's entries, oldest use first (directories only: the .lock files and unfinished .tmp-* go with
    them or are ignored)."""
    found = []
    for kind in KINDS:
        for path in sorted((root / kind).glob("*")) if (root / kind).is_dir() else []:
            if path.is_dir() and not path.name.startswith(".tmp-"):
                size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                found.append(Entry(kind, path, size, path.stat().st_mtime))
    return sorted(found, key=lambda e: e.last_used)


def in_use(entry: Entry) -> bool:
    """Is a process making this entry now (holding its lock)?"""
    if not entry.lock.is_file():
        return False
    with open(entry.lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def prune(root: Path, unused_for_days: float, *, dry_run: bool = False, now: float | None = None) -> list[Entry]:
    """Remove (unless dry_run) the model entries last used more than unused_for_days ago and not in use; the
    ones removed (or that would be)."""
    if unused_for_days < 0:
        raise ValueError(f"--unused-for must be >= 0 days, got {unused_for_days:g}")
    cutoff = (time.time() if now is None else now) - unused_for_days * DAY_S
    gone = [e for e in entries(root) if e.kind in PRUNABLE and e.last_used <= cutoff and not in_use(e)]
    if not dry_run:
        for e in gone:
            shutil.rmtree(e.path, ignore_errors=True)
            e.lock.unlink(missing_ok=True)
    return gone


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def _age(seconds: float) -> str:
    days = seconds / DAY_S
    return f"{days:.1f} days ago" if days >= 1 else f"{seconds / 3600:.1f} hours ago"


def run(args: argparse.Namespace) -> int:
    now = time.time()
    if args.action == "prune":
        try:
            gone = prune(args.root, args.unused_for, dry_run=args.dry_run, now=now)
        except ValueError as e:
            print(f"kvfleet cache prune: error: {e}")
            return 2
        verb = "would remove" if args.dry_run else "removed"
        for e in gone:
            print(f"{verb} {e.kind}/{e.path.name} ({_size(e.size)}, last used {_age(now - e.last_used)})")
        print(f"{verb} {len(gone)} entr{'y' if len(gone) == 1 else 'ies'}, {_size(sum(e.size for e in gone))}")
        return 0
    found = entries(args.root)
    if not found:
        print(f"{args.root}: empty")
        return 0
    print(f"{'kind':<12} {'size':>9}  {'last used':<16} name")
    for e in found:
        print(f"{e.kind:<12} {_size(e.size):>9}  {_age(now - e.last_used):<16} {e.path.name}")
    print(f"{len(found)} entries, {_size(sum(e.size for e in found))} in {args.root}")
    return 0
