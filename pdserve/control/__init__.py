"""The P:D controller: signals, a pure policy choosing the numbers of prefill and decode
workers, per-worker capacity models, and a discrete-event simulator that drives the same
policy and the router's own placement objects (`pdserve simulate`, `pdserve plan`).

Policy apart from mechanism: nothing here does I/O or imports a worker, Ray or gRPC. The live
cluster plugs in through `pdserve.control.actuator.Actuator` (see docs/controller.md).
"""
