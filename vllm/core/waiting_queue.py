"""The scheduler's waiting queue, one class per scheduling policy (SchedulerConfig.scheduling_policy).

Both hand out the request to admit next (`first`, `pop_first`) and take back one that could
not stay running or was passed over this step (`put_back`). They differ only in where a
request goes: FCFS keeps arrival order and puts a request back in front, as it was before;
priority keeps every request at its (priority, arrival) place, whatever brought it there.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Iterator

from vllm.core.request import Request


class FCFSWaitingQueue:
    """Arrival order. A request put back (preempted, or passed over this step) goes first:
    it arrived before everything still waiting."""

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._requests.append(req)

    def put_back(self, req: Request) -> None:
        self._requests.appendleft(req)

    def first(self) -> Request:
        return self._requests[0]

    def pop_first(self) -> Request:
        return self._requests.popleft()

    def remove(self, req: Request) -> None:
        """ValueError if `req` is not waiting."""
        self._requests.remove(req)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


class PriorityWaitingQueue:
    """Ordered by Request.scheduling_key, (priority, arrival order), smallest first. A list
    kept sorted rather than a heap: removing an aborted request and reading the order (stats,
    tests) stay simple, and insertion's O(n) move is cheap next to a step."""

    def __init__(self) -> None:
        self._requests: list[Request] = []

    def add(self, req: Request) -> None:
        bisect.insort(self._requests, req, key=_key)

    # a preempted request or one passed over this step goes back to its (priority, arrival) place
    put_back = add

    def first(self) -> Request:
        return self._requests[0]

    def pop_first(self) -> Request:
        return self._requests.pop(0)

    def remove(self, req: Request) -> None:
        """ValueError if `req` is not waiting (keys are unique: arrival orders are)."""
        i = bisect.bisect_left(self._requests, req.scheduling_key, key=_key)
        if i == len(self._requests) or self._requests[i] is not req:
            raise ValueError(f"request {req.req_id!r} is not waiting")
        del self._requests[i]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


def _key(req: Request) -> tuple[int, int]:
    return req.scheduling_key


def make_waiting_queue(scheduling_policy: str) -> FCFSWaitingQueue | PriorityWaitingQueue:
    if scheduling_policy == "priority":
        return PriorityWaitingQueue()
    if scheduling_policy == "fcfs":
        return FCFSWaitingQueue()
    raise ValueError(f"unknown scheduling policy {scheduling_policy!r}")
