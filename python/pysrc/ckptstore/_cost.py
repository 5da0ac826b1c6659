"""What a save cost the caller: `SaveCost`, returned by the saves of
`ckptstore.dcp.Tiers`, `ckptstore.lightning` and `ckptstore.transformers`
and logged where the framework lets a plugin log."""

from dataclasses import dataclass
from typing import Dict


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
