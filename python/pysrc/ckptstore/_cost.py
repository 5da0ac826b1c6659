"""What a save cost the caller: `SaveCost`, returned by the saves of
`ckptstore.dcp.Tiers`, `ckptstore.lightning` and `ckptstore.transformers`
and logged where the framework lets a plugin log."""

import time
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

from ._ckptstore import SaveRecord


@dataclass(frozen=True)
class SaveCost:
    """What one save of `step` (one rank's) cost: seconds the caller was
    blocked (a synchronous save: until the step was durable; an async one:
    until its state was staged), seconds staging took (the copy of the
    state that later changes leave alone; 0 when nothing was staged),
    seconds from the call until the step was durable, and the bytes its
    commits wrote new and referenced from earlier steps instead
    (deduplicated)."""

    step: int
    blocked_seconds: float
    staging_seconds: float
    durable_seconds: float
    bytes_new: int
    bytes_deduplicated: int

    def as_metrics(self, prefix: str = "checkpoint/") -> Dict[str, float]:
        """The cost as metrics to log: `{prefix}blocked_s`, `staging_s`,
        `durable_s`, `new_mib`, `deduplicated_mib`."""
        return {
            f"{prefix}blocked_s": self.blocked_seconds,
            f"{prefix}staging_s": self.staging_seconds,
            f"{prefix}durable_s": self.durable_seconds,
            f"{prefix}new_mib": self.bytes_new / 2**20,
            f"{prefix}deduplicated_mib": self.bytes_deduplicated / 2**20,
        }


class Clock:
    """One save's cost as it is measured, from the call (or `started`)
    until the save is durable (`cost`). `staged` records a staged save's
    staging: its seconds and how long it blocked the caller (the staging
    itself, or none for a copy made in the background). The one rule for
    `blocked_seconds`: what staging blocked, for a staged save; else the
    whole time until durable."""

    def __init__(self, started: Optional[float] = None, staging: Optional[Tuple[float, float]] = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.staging = staging

    def staged(self, seconds: float, blocked: Optional[float] = None) -> None:
        self.staging = (seconds, seconds if blocked is None else blocked)

    def record(self, names: Iterable[str] = ()) -> Optional[SaveRecord]:
        """The step's save record: a staged save's staging (which `ckpt
        show` shows) and `names`; None when there is neither."""
        names = list(names)
        if self.staging is None and not names:
            return None
        if self.staging is None:
            return SaveRecord(names=names)
        staging, blocked = self.staging
        return SaveRecord(staging_seconds=staging, blocked_seconds=blocked, names=names)

    def cost(self, step: int, bytes_new: int, bytes_deduplicated: int) -> SaveCost:
        """The save's cost, now that it is durable."""
        durable = time.perf_counter() - self.started
        staging, blocked = self.staging if self.staging is not None else (0.0, durable)
        return SaveCost(step, blocked, staging, durable, bytes_new, bytes_deduplicated)
