"""The node-local tier on disk (`ckptstore.dcp.Tiers`): which node holds
which ranks and whose copies, the stores in a node's directory, and the
records that say a step is complete.

A node's directory (`local` with `{node}` replaced by the node's index):

    rank-RRRRR.ckpt            rank R's own shards, one store step per step
    copies-of-RRRRR.ckpt       copies of rank R's shards kept on this node
    records/step-SSSSSSSSSSSSSSSSSSSS.rank-RRRRR.json
                               rank R's record of step S (written last)
    records/step-SSSSSSSSSSSSSSSSSSSS.in-bucket
                               step S (the save the file names) is whole
                               in the bucket

A record is written by every rank only after every rank's shard and every
copy is durable, so one record anywhere proves its save complete; the
shards' content digests in it tell a shard or copy of that save from one
of another save of the same step. The format is in docs/design.md.
"""

import json
import os
import re
import warnings
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

RECORD_FORMAT = 1
_RECORDS = "records"
_RECORD = re.compile(r"^step-(\d{20})\.rank-(\d{5})\.json$")
_IN_BUCKET = re.compile(r"^step-(\d{20})\.in-bucket$")
_STORE = re.compile(r"^(rank|copies-of)-(\d{5})\.ckpt$")


@dataclass(frozen=True)
class Topology:
    """`world` ranks on nodes of `per_node` ranks: node `i` holds ranks
    `i*per_node .. i*per_node+per_node-1` (the last node may hold fewer)."""

    world: int
    per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.world // self.per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, min(self.world, (node + 1) * self.per_node))

    def holders(self, src: int, peers: int) -> List[int]:
        """The ranks that keep copies of rank `src`'s shards: the rank in
        the same place on each of the next `peers` nodes (as many as there
        are other nodes)."""
        node, place = self.node_of(src), src % self.per_node
        out = []
        for j in range(1, min(peers, self.nodes - 1) + 1):
            ranks = self.ranks_of((node + j) % self.nodes)
            out.append(ranks[place % len(ranks)])
        return out

    def sources(self, holder: int, peers: int) -> List[int]:
        """The ranks whose copies `holder` keeps."""
        return [src for src in range(self.world) if holder in self.holders(src, peers)]


def node_directory(local: str, node: int) -> str:
    return local.replace("{node}", str(node))


def own_store(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank:05}.ckpt")


def copy_store(directory: str, src: int) -> str:
    return os.path.join(directory, f"copies-of-{src:05}.ckpt")


def stores_in(directory: str) -> List[Tuple[str, int, str]]:
    """The stores in a node's directory: (kind "own" or "copy", the rank
    whose shards it holds, path), in name order."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _STORE.match(name)
        if m and os.path.isfile(os.path.join(directory, name)):
            out.append(("own" if m.group(1) == "rank" else "copy", int(m.group(2)), os.path.join(directory, name)))
    return out


@dataclass(frozen=True)
class Record:
    """That save `saved_at` of `step` is complete on the local tier: every
    rank's shard (content digest `digests[r]`, entry sizes `sizes[r]`) and
    every copy (`copies[r]`: the ranks keeping rank r's) was durable. DCP's
    metadata (ckptstore.dcp's JSON) is kept with it."""

    step: int
    saved_at: int
    ranks_per_node: int
    digests: Tuple[str, ...]
    copies: Tuple[Tuple[int, ...], ...]
    sizes: Tuple[Dict[str, int], ...]
    upload: bool
    metadata: str
    # What the save cost the rank that wrote this record (SaveCost's
    # fields), if it says.
    cost: Optional[Dict[str, float]] = None
    # The save's place in the order of saves on the tier: one more than
    # the newest any rank had recorded (0 in records of 0.4.0, which come
    # before every later save and among themselves by `saved_at`).
    seq: int = 0

    @property
    def world_size(self) -> int:
        return len(self.digests)

    @property
    def key(self) -> Tuple[int, int]:
        """Which save of which step."""
        return (self.step, self.saved_at)

    @property
    def order(self) -> Tuple[int, int, int]:
        """The order of saves: later saves sort last, whatever their step
        numbers (a run that starts again at step 0 saves newer steps)."""
        return (self.seq, self.saved_at, self.step)

    def encode(self) -> bytes:
        extra: Dict[str, object] = {} if self.cost is None else {"cost": self.cost}
        if self.seq:
            extra["seq"] = self.seq
        return json.dumps(
            {
                "format": RECORD_FORMAT,
                "step": self.step,
                "saved_at": self.saved_at,
                "ranks_per_node": self.ranks_per_node,
                "digests": list(self.digests),
                "copies": [list(c) for c in self.copies],
                "sizes": list(self.sizes),
                "upload": self.upload,
                "metadata": self.metadata,
                **extra,
            },
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def decode(data: bytes, path: str) -> "Record":
        try:
            js = json.loads(data)
            if js.get("format") != RECORD_FORMAT:
                raise ValueError(f"unknown record format {js.get('format')!r}")
            record = Record(
                step=int(js["step"]),
                saved_at=int(js["saved_at"]),
                ranks_per_node=int(js["ranks_per_node"]),
                digests=tuple(str(d) for d in js["digests"]),
                copies=tuple(tuple(int(r) for r in c) for c in js["copies"]),
                sizes=tuple({str(k): int(v) for k, v in s.items()} for s in js["sizes"]),
                upload=bool(js["upload"]),
                metadata=str(js["metadata"]),
                cost=None if js.get("cost") is None else {str(k): float(v) for k, v in js["cost"].items()},
                seq=int(js.get("seq", 0)),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"{path}: damaged tier record: {e}") from None
        if not (len(record.digests) == len(record.copies) == len(record.sizes)):
            raise ValueError(f"{path}: damaged tier record: lists of different lengths")
        return record


def durable_write(path: str, chunks: Iterable[bytes]) -> None:
    """Write `chunks` to `path` durably and atomically: a temporary file,
    fsynced, renamed over `path`, the directory fsynced. A crash leaves the
    old file or the new one, whole."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_directory(os.path.dirname(path) or ".")


def sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _record_path(directory: str, step: int, rank: int) -> str:
    return os.path.join(directory, _RECORDS, f"step-{step:020}.rank-{rank:05}.json")


def _in_bucket_path(directory: str, step: int) -> str:
    return os.path.join(directory, _RECORDS, f"step-{step:020}.in-bucket")


def write_record(directory: str, rank: int, record: Record) -> None:
    os.makedirs(os.path.join(directory, _RECORDS), exist_ok=True)
    durable_write(_record_path(directory, record.step, rank), [record.encode()])


def remove_record(directory: str, step: int, rank: int) -> None:
    for path in (_record_path(directory, step, rank), _in_bucket_path(directory, step)):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def mark_in_bucket(directory: str, record: Record) -> None:
    os.makedirs(os.path.join(directory, _RECORDS), exist_ok=True)
    durable_write(_in_bucket_path(directory, record.step), [str(record.saved_at).encode()])


def in_bucket(directory: str, record: Record) -> bool:
    """Whether the bucket holds this save of the step whole (as far as this
    node was told)."""
    try:
        with open(_in_bucket_path(directory, record.step), "rb") as f:
            return f.read().strip() == str(record.saved_at).encode()
    except FileNotFoundError:
        return False


def records_in(directory: str, rank: Optional[int] = None) -> Dict[Tuple[int, int], Record]:
    """The records in a node's directory (of rank `rank` only, if given),
    by save; a damaged one is skipped with a warning (another rank's copy
    of the same record, or an older step, serves)."""
    folder = os.path.join(directory, _RECORDS)
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return {}
    out: Dict[Tuple[int, int], Record] = {}
    for name in names:
        m = _RECORD.match(name)
        if not m or (rank is not None and int(m.group(2)) != rank):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                record = Record.decode(f.read(), path)
        except (OSError, ValueError) as e:
            warnings.warn(f"ckptstore.dcp.Tiers: {e}; skipped", stacklevel=2)
            continue
        if record.step != int(m.group(1)):
            warnings.warn(f"ckptstore.dcp.Tiers: {path} records step {record.step}; skipped", stacklevel=2)
            continue
        out[record.key] = record
    return out
