"""The package's exceptions, as users import them (`ckptstore.Error`,
...): the compiled core's classes, named so that they pickle by those
names (DCP sends a rank's exception to the coordinator pickled, and its
process mode between processes)."""

from ._ckptstore import CorruptError, Error, LockedError, StepExistsError

__all__ = ["CorruptError", "Error", "LockedError", "StepExistsError"]

# `ckptstore.Error`, not the compiled core's `CkptError`.
for _error in (Error, StepExistsError, CorruptError, LockedError):
    _error.__module__ = "ckptstore"
Error.__name__ = Error.__qualname__ = "Error"
