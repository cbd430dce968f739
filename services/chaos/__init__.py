"""The chaos soak (`kvfleet chaos`, tests/chaos): a real fleet under a steady mixed load while faults are
injected at random with a fixed seed, then checks that nothing accepted was lost or doubled.

  fleet    the fleet under test (Redis with AOF, workers, gateways, a Celery worker), supervised like `kvfleet up`
  load     the request catalogue and the HTTP clients (the real `openai` client), one Record per request
  jobs     the doors without HTTP: the Python client (whole, streamed, cancelled), Celery tasks, batch files
  faults   the injector: worker SIGKILL / SIGTERM / SIGSTOP, gateway SIGKILL / SIGSTOP, Redis restart / SIGSTOP,
           CLIENT KILL, poison
  soak     one run: reference, load with faults, drain
  report   the checks and the tables
  command  the `kvfleet chaos` subcommand
"""
