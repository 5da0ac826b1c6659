//! What a step records of how it was saved, beside its training state: the
//! cost of a staged save and the names frameworks saved the step under.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// How a step was saved: typed attributes of the step, kept apart from its
/// metrics (which are the training run's own figures).
///
/// Empty by default; an empty record is left out of every format, so a step
/// without one is stored exactly as before this record existed.
///
/// ```
/// use ckptstore::{SaveRecord, Staging};
///
/// let record = SaveRecord::default()
///     .with_staging(Staging::new(0.8, 0.05).expect("finite"))
///     .with_name("lightning:checkpoints/last.ckpt");
/// assert_eq!(record.staging.map(|s| s.blocked_seconds), Some(0.05));
/// assert!(record.names.contains("lightning:checkpoints/last.ckpt"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SaveRecord {
    /// The cost of a staged save (one that copied the state, then wrote it
    /// while training went on); `None` for a save that wrote in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging: Option<Staging>,
    /// The names a framework saved the step under, prefixed with the
    /// framework (`lightning:<checkpoint path>`).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub names: BTreeSet<String>,
}

/// What staging a save cost, in seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Staging {
    /// Copying the state out of the training loop's memory.
    pub staging_seconds: f64,
    /// How long the training loop waited for the save to let it go on.
    pub blocked_seconds: f64,
}

/// The metrics 0.4.0 recorded a staged save's cost as.
const LEGACY_STAGING: &str = "ckptstore.staging_s";
const LEGACY_BLOCKED: &str = "ckptstore.blocked_s";
/// The prefix of 0.4.0's Lightning names, recorded as metrics of value 1.
const LEGACY_LIGHTNING: &str = "lightning:";

impl Staging {
    /// A staging cost, or `None` unless both figures are finite and not
    /// negative.
    pub fn new(staging_seconds: f64, blocked_seconds: f64) -> Option<Staging> {
        let valid = |v: f64| v.is_finite() && v >= 0.0;
        (valid(staging_seconds) && valid(blocked_seconds)).then_some(Staging {
            staging_seconds,
            blocked_seconds,
        })
    }
}

impl SaveRecord {
    /// This record with the cost of a staged save.
    #[must_use]
    pub fn with_staging(mut self, staging: Staging) -> Self {
        self.staging = Some(staging);
        self
    }

    /// This record with one more name the step was saved under.
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.names.insert(name.into());
        self
    }

    /// Whether it records nothing (and is left out of the step's formats).
    pub fn is_empty(&self) -> bool {
        self.staging.is_none() && self.names.is_empty()
    }

    /// Check that its staging is as [`Staging::new`] requires (the
    /// checkpoint holds its names to its text cap).
    pub(crate) fn check(&self, step: u64) -> Result<()> {
        let invalid = |reason: String| Error::InvalidCheckpoint { step, reason };
        if let Some(s) = self.staging {
            if Staging::new(s.staging_seconds, s.blocked_seconds).is_none() {
                return Err(invalid(format!(
                    "its save took {} s staging and blocked {} s; each must be finite \
                     and not negative",
                    s.staging_seconds, s.blocked_seconds
                )));
            }
        }
        Ok(())
    }

    /// The record of a step 0.4.0 wrote, which kept it among the step's
    /// metrics: a staged save's `ckptstore.staging_s` and
    /// `ckptstore.blocked_s` (both, finite), and Lightning's
    /// `lightning:<path>` = 1.0 for each such name that `is_entry` says is
    /// one of the step's blobs. Those metrics move into the record; every
    /// other metric stays. Used only where a step has no record of its own.
    pub(crate) fn from_legacy_metrics(
        metrics: &mut BTreeMap<String, f64>,
        is_entry: impl Fn(&str) -> bool,
    ) -> SaveRecord {
        let mut record = SaveRecord::default();
        let pair = (metrics.get(LEGACY_STAGING), metrics.get(LEGACY_BLOCKED));
        if let (Some(&staging), Some(&blocked)) = pair {
            if let Some(s) = Staging::new(staging, blocked) {
                record.staging = Some(s);
                metrics.remove(LEGACY_STAGING);
                metrics.remove(LEGACY_BLOCKED);
            }
        }
        #[allow(clippy::float_cmp)] // 0.4.0 wrote exactly 1.0
        let lightning =
            |n: &str, v: f64| n.starts_with(LEGACY_LIGHTNING) && v == 1.0 && is_entry(n);
        let names: Vec<String> = metrics
            .iter()
            .filter(|(n, v)| lightning(n, **v))
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            metrics.remove(&name);
            record.names.insert(name);
        }
        record
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_0_4_0s_own_metrics_move_into_the_record() {
        let mut metrics: BTreeMap<String, f64> = [
            ("loss", 0.5),
            ("ckptstore.staging_s", 0.25),
            ("ckptstore.blocked_s", 0.01),
            ("lightning:a.ckpt", 1.0),
            ("lightning:gone.ckpt", 1.0), // not a blob of the step
            ("lightning:lr", 2.0),        // a value Lightning never wrote
        ]
        .map(|(n, v)| (n.to_owned(), v))
        .into();
        let record = SaveRecord::from_legacy_metrics(&mut metrics, |n| n == "lightning:a.ckpt");
        assert_eq!(record.staging, Staging::new(0.25, 0.01));
        assert_eq!(record.names, ["lightning:a.ckpt".to_owned()].into());
        let left: Vec<&str> = metrics.keys().map(String::as_str).collect();
        assert_eq!(left, ["lightning:gone.ckpt", "lightning:lr", "loss"]);

        // Half a cost stays a metric.
        let mut half: BTreeMap<String, f64> = [("ckptstore.staging_s".to_owned(), 0.2)].into();
        assert!(SaveRecord::from_legacy_metrics(&mut half, |_| true).is_empty());
        assert_eq!(half.len(), 1);
    }

    #[test]
    fn a_cost_must_be_finite_and_not_negative() {
        assert!(Staging::new(f64::NAN, 0.0).is_none());
        assert!(Staging::new(0.0, -1.0).is_none());
        assert!(Staging::new(0.0, f64::INFINITY).is_none());
        let negative = SaveRecord::default().with_staging(Staging {
            staging_seconds: -1.0,
            blocked_seconds: 0.0,
        });
        assert!(matches!(
            negative.check(3),
            Err(Error::InvalidCheckpoint { step: 3, .. })
        ));
    }
}
