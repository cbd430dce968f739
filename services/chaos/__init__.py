"""The chaos soak (`kvfleet chaos`, tests/chaos): a real fleet under a steady mixed load while faults are
injected at random with a fixed seed, then checks that nothing accepted was lost or doubled.

  fleet    the fleet under test (Redis with AOF, workers, gateways), supervised like `kvfleet up`
  load     the request catalogue and the clients (the real `openai` client), one Record per request
  faults   the injector: worker SIGKILL / SIGTERM / SIGSTOP, gateway SIGKILL, Redis restart, CLIENT KILL, poison
  soak     one run: reference, load with faults, drain
  report   the checks and the tables
  command  the `kvfleet chaos` subcommand
"""
