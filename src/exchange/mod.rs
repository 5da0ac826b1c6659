//! Exchange formats: safetensors in and out, and the metadata
//! `ckptstore.dcp` keeps beside a DCP step (`dcp`).
//!
//! A step is exported as a standard safetensors file: every typed tensor
//! with its dtype and shape, every untyped optimizer blob as a 1-D `U8`
//! tensor of its name, and the rest of the step in `__metadata__` under
//! the keys below, so that importing an exported file gives back the same
//! checkpoint. Any other safetensors file imports too, as tensors.

pub(crate) mod dcp;
pub(crate) mod dcp_doc;
mod float;
pub mod hf;
pub(crate) mod read;
pub(crate) mod write;

/// `__metadata__` keys (values are strings, as safetensors requires).
pub(crate) const KEY_STEP: &str = "ckptstore.step";
pub(crate) const KEY_TIMESTAMP: &str = "ckptstore.timestamp";
pub(crate) const KEY_LOSS_CID: &str = "ckptstore.loss_cid";
/// Metrics as a JSON object.
pub(crate) const KEY_METRICS: &str = "ckptstore.metrics";
/// The computation graph as JSON (the seed's format).
pub(crate) const KEY_GRAPH: &str = "ckptstore.graph";
/// The step's save record as JSON (its serde form), when it has one.
pub(crate) const KEY_SAVE_RECORD: &str = "ckptstore.save_record";
/// The names that were untyped optimizer blobs, as a JSON array.
pub(crate) const KEY_BLOBS: &str = "ckptstore.blobs";

/// The safetensors header's own key.
pub(crate) const METADATA: &str = "__metadata__";
/// Largest header accepted (the safetensors library's limit).
pub(crate) const MAX_HEADER: u64 = 100_000_000;
/// Bytes of the header-length prefix.
pub(crate) const LEN_PREFIX: u64 = 8;
/// Headers are padded with spaces to a multiple of this.
pub(crate) const HEADER_ALIGN: usize = 8;

#[cfg(test)]
mod tests;
