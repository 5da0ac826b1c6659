"""Uploads from the node-local tier to the bucket (`ckptstore.dcp.Tiers`,
on its upload thread, over its upload group): every complete step due
for the bucket and not there yet that every rank still holds, oldest
first, each rank's shard read and uploaded in Rust, rank 0's commit
naming them all."""

from typing import Any, Callable, Dict, List, Optional, Tuple

from ..._store import Store
from .._bucket import remote_of
from .._targets import METADATA
from .._wire import Group, attempt, described
from ._layout import Record, records_in
from ._node import Node
from ._save import SIZES


class Upload:
    """Rank `node.rank`'s side of the uploads to `bucket`; `uploaded(step)`
    is called once a step is whole there (an exception it raises fails
    that upload); `compress`: whether chunks are stored compressed where
    that saves bytes (None: as the bucket's scheme says)."""

    def __init__(
        self, node: Node, group: Group, bucket: str, uploaded: Optional[Callable[[int], None]], compress: Optional[bool]
    ) -> None:
        self._node, self._group, self._bucket, self._uploaded = node, group, bucket, uploaded
        self._compress = compress

    def pending(self) -> None:
        """Upload every complete step due for the bucket and not there yet
        that every rank still holds, oldest first."""
        node = self._node

        def due() -> Tuple[Store, Dict[Tuple[int, int], Record], List[Tuple[int, int]]]:
            own = node.own()
            records = records_in(node.tier, node.rank)
            keys = sorted(
                key
                for key, r in records.items()
                if r.upload
                and r.world_size == node.topology.world
                and not node.tier.in_bucket(r.key)
                and own.content_digest(r.step) == r.digests[node.rank]
            )
            return own, records, keys

        found, failed = attempt(due)
        with self._group.on("uploads due"):
            self._group.check(failed, "uploading to the bucket")
        assert found is not None
        own, records, keys = found
        agreed = set.intersection(*(set(map(tuple, p)) for p in self._group.gather(keys)))
        for key in sorted(agreed):
            self._one(records[key], own)

    def _one(self, record: Any, own: Store) -> None:
        rank, group = self._node.rank, self._group
        remote = None
        shard, failure = "", ""
        try:
            remote = remote_of(self._bucket, self._compress)
            # Read and uploaded in Rust, less the tier's own entry; a save
            # of 0.4.0 has DCP's metadata in its record.
            extra = {METADATA: record.metadata.encode()} if rank == 0 and record.metadata is not None else {}
            shard = remote.upload_shard_from(own, record.step, rank, record.world_size, [SIZES], extra).shard
        except Exception as e:  # noqa: BLE001 - told to every rank
            failure = f"rank {rank}: {described(e)}"
        told = group.gather((shard, failure))
        if remote is not None and rank == 0 and not any(f for _, f in told):
            try:
                remote.commit_global(record.step, [s for s, _ in told])
            except Exception as e:  # noqa: BLE001 - told to every rank
                failure = f"committing: {described(e)}"
        failures = [f for _, f in told if f] + [group.broadcast(failure if rank == 0 else "", 0)]
        failures = [f for f in failures if f]
        if failures:
            raise RuntimeError(f"step {record.step} was not uploaded to {self._bucket}: " + "; ".join(dict.fromkeys(failures)))
        self._node.tier.mark_in_bucket(record.key)
        if self._uploaded is not None:
            self._uploaded(record.step)
