"""`EngineStopped`: what an engine whose step loop died answers every call with.

The loop itself runs in the worker (`pdserve.worker.engine_loop`); the error stays here, free of
torch, because the router imports it to tell a stopped worker from a busy one."""

from __future__ import annotations


class EngineStopped(RuntimeError):
    """The engine loop died with an error: nothing this worker's engine is given will run.

    Built from its message alone, so it survives pickling (a Ray actor's error reaches the
    router as a subclass of this type, rebuilt from its `args`)."""

    @classmethod
    def of(cls, loop_name: str, cause: BaseException) -> EngineStopped:
        return cls(f"the engine loop of {loop_name} stopped: {type(cause).__name__}: {cause}")
