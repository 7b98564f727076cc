"""A scaler host that records its adds (no actors), shared by the scaler's placement tests."""

from __future__ import annotations


class RecordingHosts:
    """The scaler's host, recording the adds (no actors: the check under test comes before them)."""

    def __init__(self) -> None:
        self.added: list[str] = []

    def worker_count(self) -> int:
        return 2

    async def add_worker(self, role: str) -> str:
        self.added.append(role)
        return f"{role}-{len(self.added)}"

    def stop_worker(self, worker_id: str) -> None:
        raise AssertionError("no removal here")
