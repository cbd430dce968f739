"""`kvfleet worker`: run one engine worker that serves its Redis stream (gpu_worker.serve.worker).

SIGTERM drains: take nothing new, hand back what has not started, finish the rest within --drain-timeout,
leave what is still unfinished pending (another worker claims it and continues), and exit. Exit status 1:
the worker stopped serving because of a fault (see gpu_worker.serve.worker); its supervisor restarts it.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from gpu_worker.core.policies import policy_class
from gpu_worker.serve.worker import Worker
from shared import keys, telemetry
from shared.gc_heap import freeze_startup_heap
from shared.settings import Settings, hf_offline

log = logging.getLogger("kvfleet.worker")


def _scheduling_policy(spec: str) -> str:
    """--scheduling-policy: a user's class is imported while the flags are parsed, so a wrong name fails at once."""
    try:
        policy_class(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def cpu_list(spec: str) -> list[int]:
    """--cpus (and `kvfleet up --worker-cpus`): "0-3", "0,2", "0-1,4" -> the CPU ids, which must exist and be
    allowed to this process."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            low, dash, high = part.partition("-")
            cpus.update(range(int(low), int(high if dash else low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cpus: {spec!r} is not a CPU list like 0-3 or 0,2") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise argparse.ArgumentTypeError(f"--cpus: {spec!r} names CPUs this process may not use; allowed: "
                                         f"{sorted(allowed)}")
    return sorted(cpus)


def _bind(args: argparse.Namespace) -> None:
    """Pin to --cpus and size torch's thread pool before anything creates it."""
    if args.cpus is None and args.threads is None:
        return
    import torch

    if args.cpus is not None:
        os.sched_setaffinity(0, args.cpus)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    log.info("compute threads: %d%s", threads, f" on CPUs {args.cpus}" if args.cpus is not None else "")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", help="Redis URL (redis://, rediss://, with password); env KVFLEET_REDIS_URL")
    p.add_argument("--model", help="HF directory, .gguf file or the default alias; env KVFLEET_MODEL")
    p.add_argument("--served-model-name", help="the name clients use (default: the engine's model name)")
    p.add_argument("--worker-id", help="stable id (its stream is kvfleet:{sN}:req:ID, N its shard); default host-pid")
    p.add_argument("--num-kv-blocks", type=int, help="KV cache size in blocks")
    p.add_argument("--kv-cache-memory", help="KV cache size in memory, e.g. 2GiB (instead of --num-kv-blocks)")
    p.add_argument("--block-size", type=int, help='tokens per KV-cache block (default 16; simulated: its profile\'s)')
    p.add_argument("--max-num-seqs", type=int, help='most sequences in one batch (default 128; simulated: its profile\'s)')
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="token budget of one engine step, prefill chunks + decodes (default 2048; simulated: its "
                        "profile's)")
    p.add_argument("--max-model-len", type=int, help="context window (default: the model's)")
    p.add_argument("--scheduling-policy", type=_scheduling_policy, default="fcfs", metavar="POLICY",
                   help="which waiting request is admitted next and which running one is preempted first: fcfs "
                        "(first come, first served), priority (lower value first), sjf (fewest tokens first, with "
                        "aging) or package.module:Class (a gpu_worker.core.policies.SchedulingPolicy subclass)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", help='turn off automatic prefix caching')
    p.add_argument("--dtype", default="float32", help='weights and KV cache dtype: float32, bfloat16 or float16')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N devices, as vLLM's flag does: this process is rank 0 (it schedules) "
                        "and starts N-1 executor processes; attention heads, KV heads, the MLP and the vocabulary "
                        "are divided among them (NCCL on cuda:0..N-1; on CPU, gloo, each rank on its share of "
                        "--cpus / --threads). N must divide the attention heads and the MLP size, and divide or "
                        "be a multiple of the KV heads")
    p.add_argument("--device", default="cpu", help='cpu or cuda')
    p.add_argument("--seed", type=int, default=0, help='seed for requests that give none')
    p.add_argument("--log-memory-usage", type=float, default=0.0, metavar="SECONDS",
                   help="log the KV cache's blocks used / free / cached, fragmentation and preemptions every "
                        "SECONDS (0: off)")
    p.add_argument("--cpus", type=cpu_list, metavar="LIST",
                   help="bind the worker to these CPUs (e.g. 0-3 or 0,2): its compute threads then never share a "
                        "core with another worker's (`kvfleet up` gives each worker its own when cores suffice)")
    p.add_argument("--threads", type=int,
                   help="compute threads (default: one per CPU the worker may use; see --cpus); more threads than "
                        "free cores make every step wait for the slowest")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up (a long prefill, a batch of sampled decodes and n=2 through the engine, "
                        "then a wait until the KV cache is resident, before the worker registers, so the first "
                        "request pays no first-call costs or page faults; KVFLEET_KV_PREFAULT=0 skips the wait "
                        "alone)")
    p.add_argument("--async-output", action="store_true",
                   help="overlap each step's output processing (detokenizing, stop strings, the chunks for Redis) "
                        "with the next step's forward, which then runs on a thread of its own (vLLM v0's async "
                        "output processing): for GPU workers, whose forward leaves the CPU idle; on a CPU worker the "
                        "forward already has every core, so it is off by default")
    p.add_argument("--step-log", metavar="FILE",
                   help="append one JSON line per engine step (its shape and wall-clock seconds) to FILE, for "
                        "`kvfleet bench calibrate --from-steps FILE`")
    p.add_argument("--metrics-port", type=int, help="serve /livez, /readyz, /metrics on this port")
    p.add_argument("--metrics-host", help="address for --metrics-port (default 127.0.0.1; 0.0.0.0 in pods; env "
                                          "KVFLEET_METRICS_HOST)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    p.add_argument("--status-ttl", type=float, help="seconds a status lives without a heartbeat")
    p.add_argument("--max-deliveries", type=int, help="deliveries before a request goes to kvfleet:dead")
    p.add_argument("--simulate", metavar="PROFILE",
                   help="a simulated worker: the real worker with the model replaced by a cost profile (a name in "
                        "gpu_worker/executor/profiles/, e.g. smollm2-cpu, or a .json from `kvfleet bench "
                        "calibrate`): each step sleeps for its cost, tokens are a function of seed, request and "
                        "position; only the model's tokenizer and config are loaded")


def _engine(args: argparse.Namespace, model: str):
    """The real engine, or with --simulate the engine over a cost profile."""
    if args.async_output and args.step_log:
        raise ValueError("--step-log times each step with its forward, and --async-output leaves the forward "
                         "running past the step; use one or the other")
    common = dict(num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
                  enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
                  seed=args.seed, log_memory_usage_s=args.log_memory_usage)
    if args.simulate:
        import torch

        if args.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size: a simulated worker has no model to split")
        if args.async_output:
            raise ValueError("--async-output: a simulated worker's steps already count the engine's own work "
                             "within the forward's time, as if it overlapped")
        from gpu_worker.engine.simulated import simulated_engine

        torch.set_num_threads(1)  # it only samples: one thread, so many simulated workers share a few cores
        if args.kv_cache_memory is not None:
            raise ValueError("--kv-cache-memory: a simulated worker holds no KV data; size its cache with "
                             "--num-kv-blocks (default: the profile's num_kv_blocks)")
        return simulated_engine(args.simulate, model, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens, **common)
    from gpu_worker.engine.llm_engine import LLMEngine

    return LLMEngine.from_model(model, dtype=args.dtype, device=args.device, block_size=args.block_size or 16,
                                kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs or 128,
                                max_num_batched_tokens=args.max_num_batched_tokens or 2048,
                                tensor_parallel_size=args.tensor_parallel_size, async_output=args.async_output,
                                **common)


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    hf_offline()
    telemetry.setup_tracing("kvfleet-worker")
    settings = Settings.from_env(redis_url=args.redis_url, model=args.model, worker_id=args.worker_id,
                                 status_ttl_s=args.status_ttl, max_deliveries=args.max_deliveries,
                                 metrics_host=args.metrics_host)
    keys.validate_worker_id(settings.worker_id)
    if settings.redis_shards < 1:
        log.error("kvfleet worker cannot start: KVFLEET_REDIS_SHARDS must be >= 1, got %d", settings.redis_shards)
        return 2
    log.info("worker %s lives in shard %d of %d", settings.worker_id, settings.worker_shard, settings.redis_shards)
    from shared.models import resolve_model

    worker: Worker | None = None  # the probes answer while the model loads: alive, not ready
    health = None
    if args.metrics_port is not None:
        from gpu_worker.serve.health_server import HealthServer

        health = HealthServer(args.metrics_port, lambda: worker.live() if worker else (True, "loading the model"),
                              lambda: worker.ready() if worker else (False, "loading the model"),
                              host=settings.metrics_host).start()
    try:
        if not args.simulate:
            _bind(args)
        from gpu_worker.executor.model_runner import RunnerFault

        try:
            engine = _engine(args, settings.model)
        except (ValueError, RunnerFault) as e:  # a setting the model or machine cannot meet; ranks that never met
            log.error("kvfleet worker cannot start: %s", e)
            return 2
        if args.warmup and not args.simulate:
            from gpu_worker.engine.warmup import warm_up

            log.info("%s; ready %.1f s after start", warm_up(engine, seed=args.seed).describe(),
                     time.monotonic() - started)
        freeze_startup_heap(f"worker {settings.worker_id}")
        step_log = None
        if args.step_log:
            from gpu_worker.serve.step_log import StepLog

            step_log = StepLog(args.step_log, engine)  # after the warm-up: only served steps are logged
        worker = Worker(engine, settings, model_name=args.served_model_name or engine.model_name,
                        model_path=str(resolve_model(settings.model)), drain_timeout_s=args.drain_timeout,
                        max_backlog=engine.scheduler.config.max_num_seqs,
                        simulated=getattr(engine, "simulated", None), step_log=step_log)
        if health:
            health.registry = worker.metrics.registry
        try:
            return worker.run()
        finally:
            engine.close()  # a tensor-parallel worker's executors exit with it
            if step_log is not None:
                step_log.close()
    finally:
        if health:
            health.stop()
        telemetry.shutdown()
