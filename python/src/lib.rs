//! `ckptstore._ckptstore`: the Rust side of the Python package. The Python
//! layer (`pysrc/ckptstore/`) names each array's dtype and shape; this
//! module holds the store, borrows the arrays' memory for a save, hands
//! numpy the bytes a load read, and releases the GIL while it hashes and
//! does I/O. `RawRemote` is a bucket (object storage, global steps).

mod arrays;
mod convert;
mod dcp;
mod files;
mod global_step;
mod handle;
mod pieces;
mod record;
mod remote;
mod results;
mod shard;
mod slices;
mod store;
mod tier;

use ckptstore::{BucketError, Error};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    _ckptstore,
    CkptError,
    pyo3::exceptions::PyException,
    "A ckptstore error."
);
pyo3::create_exception!(
    _ckptstore,
    StepExistsError,
    CkptError,
    "The step is stored already."
);
pyo3::create_exception!(
    _ckptstore,
    CorruptError,
    CkptError,
    "Stored data failed its integrity check."
);
pyo3::create_exception!(
    _ckptstore,
    LockedError,
    CkptError,
    "Another process holds the store for writing."
);

/// The Python exception for a store error.
pub(crate) fn py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    if e.is_locked() {
        return LockedError::new_err(msg);
    }
    // An errno only where the system gave one ("[Errno 0]" says nothing).
    if let Some(errno) = e.os_error().and_then(std::io::Error::raw_os_error) {
        return PyOSError::new_err((errno, msg));
    }
    match e {
        Error::StepExists { .. } => StepExistsError::new_err(msg),
        Error::Corrupt { .. } | Error::Poisoned { .. } => CorruptError::new_err(msg),
        Error::InvalidTensor { .. }
        | Error::InvalidCheckpoint { .. }
        | Error::InvalidOptions(_)
        | Error::RangeNotStored { .. }
        | Error::Bucket(
            BucketError::InvalidUrl { .. }
            | BucketError::ShardedStep { .. }
            | BucketError::WorldSizeMismatch { .. }
            | BucketError::PrefixOwned { .. },
        ) => PyValueError::new_err(msg),
        e if e.is_io() => PyOSError::new_err(msg),
        _ => CkptError::new_err(msg),
    }
}

/// The module.
#[pymodule]
fn _ckptstore(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<store::RawStore>()?;
    m.add_class::<remote::RawRemote>()?;
    m.add_class::<shard::ShardId>()?;
    m.add_class::<shard::ShardUpload>()?;
    m.add_class::<shard::ShardValues>()?;
    m.add_class::<shard::StoreStep>()?;
    m.add_class::<handle::Handle>()?;
    m.add_class::<arrays::Buffer>()?;
    m.add_class::<convert::PyTensor>()?;
    m.add_class::<global_step::RawGlobalStep>()?;
    m.add_class::<arrays::ChunkHashes>()?;
    m.add_class::<arrays::ChunkHasher>()?;
    m.add_class::<slices::SliceCheck>()?;
    m.add_class::<slices::ChunkMap>()?;
    m.add_function(pyo3::wrap_pyfunction!(slices::slice_proof_len, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(arrays::hash_arrays, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(arrays::copy_hashed, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(files::write_durably, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(files::remove_durably, m)?)?;
    dcp::register(m)?;
    pieces::register(m)?;
    results::register(m)?;
    tier::register(m)?;
    m.add("Error", m.py().get_type::<CkptError>())?;
    m.add("MAX_WORLD_SIZE", ckptstore::MAX_WORLD_SIZE)?;
    m.add("CHUNK_BYTES", ckptstore::CHUNK_BYTES)?;
    m.add("DCP_METADATA", ckptstore::DCP_METADATA)?;
    m.add("DCP_RANK_METADATA", ckptstore::DCP_RANK_METADATA)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("StepExistsError", m.py().get_type::<StepExistsError>())?;
    m.add("CorruptError", m.py().get_type::<CorruptError>())?;
    m.add("LockedError", m.py().get_type::<LockedError>())?;
    Ok(())
}
