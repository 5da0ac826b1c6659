//! The per-step summary record of the `summaries` table: a small JSON
//! object with the step, time, loss CID, metrics and sizes. Its codec is
//! its own, so that the public [`StepSummary`] can grow without changing
//! the file format.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Error, Result, SaveRecord, StepSummary};

/// The record as stored (the field names are the format).
#[derive(Serialize, Deserialize)]
struct Record<'a> {
    step: u64,
    timestamp: u64,
    #[serde(borrow)]
    loss_cid: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    metrics: BTreeMap<String, f64>,
    logical_bytes: u64,
    bytes_written: u64,
    blobs: u64,
    /// Left out when empty, so the record is 0.4.0's for such a step.
    #[serde(
        default,
        rename = "save_record",
        skip_serializing_if = "SaveRecord::is_empty"
    )]
    saved: SaveRecord,
}

/// Encode `summary` for the `summaries` table.
pub(crate) fn encode(summary: &StepSummary) -> Result<Vec<u8>> {
    let record = Record {
        step: summary.step,
        timestamp: summary.timestamp,
        loss_cid: summary.loss_cid.as_deref().map(Into::into),
        metrics: summary.metrics.clone(),
        logical_bytes: summary.logical_bytes,
        bytes_written: summary.bytes_written,
        blobs: summary.blobs as u64,
        saved: summary.save_record.clone(),
    };
    serde_json::to_vec(&record).map_err(|e| Error::InvalidCheckpoint {
        step: summary.step,
        reason: format!("its summary does not encode: {e}"),
    })
}

/// Decode the summary stored under `step`.
pub(crate) fn decode(step: u64, bytes: &[u8]) -> Result<StepSummary> {
    let r: Record<'_> = serde_json::from_slice(bytes)
        .map_err(|e| Error::corrupt(Some(step), format!("summary does not decode: {e}")))?;
    if r.step != step {
        return Err(Error::corrupt(Some(step), "summary names another step"));
    }
    let blobs = usize::try_from(r.blobs)
        .map_err(|_| Error::corrupt(Some(step), "summary counts too many blobs"))?;
    let mut metrics = r.metrics;
    let save_record = if r.saved.is_empty() {
        SaveRecord::from_legacy_metrics(&mut metrics, |_| false)
    } else {
        r.saved
            .check(step)
            .map_err(|_| Error::corrupt(Some(step), "summary holds an invalid save record"))?;
        r.saved
    };
    Ok(StepSummary {
        step,
        timestamp: r.timestamp,
        loss_cid: r.loss_cid.map(std::borrow::Cow::into_owned),
        metrics,
        logical_bytes: r.logical_bytes,
        bytes_written: r.bytes_written,
        stored_bytes: r.bytes_written,
        blobs,
        save_record,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_checks_its_step() -> Result<()> {
        let s = StepSummary {
            step: 4,
            timestamp: 17,
            loss_cid: Some("cid".into()),
            metrics: [("loss".to_owned(), 0.25)].into(),
            logical_bytes: 100,
            bytes_written: 60,
            stored_bytes: 60,
            blobs: 2,
            save_record: SaveRecord::default()
                .with_staging(crate::Staging::new(0.5, 0.1).expect("finite"))
                .with_name("lightning:a.ckpt"),
        };
        let bytes = encode(&s)?;
        assert_eq!(decode(4, &bytes)?, s);
        assert!(matches!(decode(5, &bytes), Err(Error::Corrupt { .. })));
        assert!(decode(4, b"{").is_err());
        // The record 0.1 and 0.2 wrote still decodes.
        let old = br#"{"step":4,"timestamp":17,"loss_cid":null,"metrics":{},"logical_bytes":1,"bytes_written":1,"blobs":1}"#;
        assert_eq!(decode(4, old)?.blobs, 1);
        // 0.4.0's staging cost, kept among the metrics, reads as a record.
        let cost = br#"{"step":4,"timestamp":17,"loss_cid":null,"metrics":{"ckptstore.staging_s":0.5,"ckptstore.blocked_s":0.1},"logical_bytes":1,"bytes_written":1,"blobs":1}"#;
        let lifted = decode(4, cost)?;
        assert!(lifted.metrics.is_empty());
        assert_eq!(lifted.save_record.staging, crate::Staging::new(0.5, 0.1));
        Ok(())
    }
}
