"""Which target a user's argument to ckptstore.dcp names: a bucket URL
(`_bucket.Bucket`) or a local store (`_local.LocalStore`); a writer's or
reader's target that is no user's (the tier's) is taken as it is."""

import os
from typing import Optional, Union

from .._store import Store
from ._bucket import Bucket
from ._local import LocalStore
from ._targets import LoadTarget, SaveTarget, UserTarget, describe_any, is_bucket_url


Target = Union["Bucket", "LocalStore"]
"""The targets a user names."""


def target_of(target: UserTarget) -> Target:
    """The target a user's argument names."""
    if is_bucket_url(target):
        return Bucket(str(target))
    return LocalStore(target)


def save_target(target: Union[UserTarget, SaveTarget], compress: Optional[bool] = None) -> SaveTarget:
    """The target a writer's argument names (a user's, or the tier's);
    `compress`: whether a bucket's chunks are stored compressed (None:
    as its scheme says, `Remote`); no other target compresses."""
    if compress is not None and is_bucket_url(target):
        return Bucket(str(target), compress=compress)
    if compress:
        raise ValueError(
            f"compress=True: only a bucket URL stores chunks compressed, not {describe_any(target)}"
        )
    return target_of(target) if isinstance(target, (str, os.PathLike, Store)) else target


def load_target(target: Union[UserTarget, LoadTarget]) -> LoadTarget:
    """The target a reader's argument names (a user's, or the tier's)."""
    return target_of(target) if isinstance(target, (str, os.PathLike, Store)) else target
