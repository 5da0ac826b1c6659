//! The document of DCP's metadata that `ckptstore.dcp` keeps in the
//! coordinator's shard (entry [`DCP_METADATA`]):
//! its one schema, written and read here. Python's `ckptstore.dcp`
//! converts DCP's `Metadata` to and from a [`DcpDocument`]'s plain values;
//! `DcpIndex` (`exchange::dcp`) reads the tensors and boxes out of one.
//!
//! ```text
//! {"format": 1, "version": V | null,
//!  "state_dict": {FQN: {"dtype", "itemsize"?, "size", "requires_grad",
//!                       "chunks": [{"offsets", "sizes"}]} | {"bytes": true}},
//!  "planner_data": [[FQN, [KEY | INDEX, ...]], ...] | null,
//!  "storage": [{"fqn", "offset" | null, "index" | null, "rank", "entry"}]}
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The entry of the coordinator's shard that holds DCP's metadata.
pub const DCP_METADATA: &str = ".dcp/metadata.json";

/// The entry of each rank's shard of a rank-local save (DCP's
/// `use_collectives=False`) that holds the metadata of that rank's own
/// items, in the schema of [`DCP_METADATA`]. Such a step has no
/// [`DCP_METADATA`]: a reader that knows only that finds none and refuses
/// the step, rather than read one rank's metadata as the whole.
pub const DCP_RANK_METADATA: &str = ".dcp/rank-metadata.json";

/// The format [`DcpDocument::encode`] writes and the one this build reads.
pub const DCP_FORMAT: u32 = 1;

/// DCP's metadata as `ckptstore.dcp` stores it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DcpDocument {
    /// [`DCP_FORMAT`].
    pub format: u32,
    /// DCP's own metadata version.
    #[serde(default)]
    pub version: Option<String>,
    /// Each value of the state by fully qualified name.
    pub state_dict: BTreeMap<String, DcpEntry>,
    /// The default planners' data: fqn -> the path of keys (a str) and
    /// indices (an int) to the value in the nested state dict.
    #[serde(default)]
    pub planner_data: Option<Vec<(String, Vec<DcpPathPart>)>>,
    /// Where each stored item is.
    pub storage: Vec<DcpWhere>,
}

/// A value of the state: a tensor (its dtype, shape and stored boxes) or
/// a non-tensor value (`bytes`: DCP's own `torch.save` bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DcpEntry {
    /// The store's dtype name (`F32`), or `torch.<name>` for a dtype
    /// safetensors has no name for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Bytes per element of a `torch.<name>` dtype.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itemsize: Option<u64>,
    /// The whole tensor's shape.
    #[serde(default)]
    pub size: Vec<u64>,
    /// DCP's `requires_grad` of the tensor.
    #[serde(default, skip_serializing_if = "is_false")]
    pub requires_grad: bool,
    /// The stored boxes.
    #[serde(default)]
    pub chunks: Vec<DcpChunk>,
    /// A non-tensor value.
    #[serde(default, skip_serializing_if = "is_false")]
    pub bytes: bool,
}

/// A stored box of a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DcpChunk {
    /// Where it starts in the whole tensor.
    pub offsets: Vec<u64>,
    /// Its sizes.
    pub sizes: Vec<u64>,
}

/// A key (`str`) or an index (`int`) of a planner's path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DcpPathPart {
    /// An index into a list.
    Index(i64),
    /// A key of a dict.
    Key(String),
}

/// Where a stored item is: rank `rank`'s entry `entry`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DcpWhere {
    /// The item's fully qualified name.
    pub fqn: String,
    /// The box's offsets (`None` for a non-tensor value).
    pub offset: Option<Vec<u64>>,
    /// DCP's index hint of the item.
    #[serde(default)]
    pub index: Option<u64>,
    /// The rank whose shard holds it.
    pub rank: u32,
    /// The entry of that shard.
    pub entry: String,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde passes &bool
fn is_false(b: &bool) -> bool {
    !*b
}

impl DcpDocument {
    /// The document as JSON.
    ///
    /// # Errors
    /// [`Error::Json`] if it cannot be written (it always can).
    pub fn encode(&self) -> Result<Vec<u8>> {
        serde_json::to_vec(self).map_err(|e| Error::Json {
            path: None,
            source: Box::new(e),
        })
    }

    /// The document of `bytes` (of step `step`, if known, for errors).
    ///
    /// # Errors
    /// [`Error::Corrupt`] for bytes that are not such a document, or one
    /// of a format this build does not read.
    pub fn decode(step: Option<u64>, bytes: &[u8]) -> Result<DcpDocument> {
        let corrupt = |why: String| Error::corrupt(step, format!("{DCP_METADATA}: {why}"));
        let doc: DcpDocument = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        if doc.format != DCP_FORMAT {
            return Err(corrupt(format!(
                "format {} is not one this build reads",
                doc.format
            )));
        }
        Ok(doc)
    }
}

#[cfg(test)]
mod tests {
    use super::{DcpDocument, DcpPathPart};
    use crate::Error;

    /// A document as 0.4.0's Python wrote it (`json.dumps`, compact).
    const WRITTEN_BY_0_4_0: &str = concat!(
        r#"{"format":1,"version":"1.0.0","state_dict":{"model.w":{"dtype":"F32","size":[4,3],"#,
        r#""requires_grad":true,"chunks":[{"offsets":[0,0],"sizes":[2,3]},{"offsets":[2,0],"#,
        r#""sizes":[2,3]}]},"extra.z":{"dtype":"torch.complex128","size":[1],"requires_grad":false,"#,
        r#""chunks":[{"offsets":[0],"sizes":[1]}],"itemsize":16},"step":{"bytes":true}},"#,
        r#""planner_data":[["model.w",["model","w"]],["opt.0",["opt",0]]],"#,
        r#""storage":[{"fqn":"model.w","offset":[0,0],"index":null,"rank":0,"entry":"t/model.w@0,0"},"#,
        r#"{"fqn":"step","offset":null,"index":null,"rank":1,"entry":"b/step"}]}"#
    );

    #[test]
    fn documents_of_0_4_0_read_and_round_trip() -> crate::Result<()> {
        let doc = DcpDocument::decode(Some(3), WRITTEN_BY_0_4_0.as_bytes())?;
        assert_eq!(doc.version.as_deref(), Some("1.0.0"));
        assert!(doc.state_dict["model.w"].requires_grad);
        assert_eq!(doc.state_dict["extra.z"].itemsize, Some(16));
        assert!(doc.state_dict["step"].bytes);
        let planner = doc.planner_data.clone().unwrap_or_default();
        assert_eq!(
            planner[1].1,
            [DcpPathPart::Key("opt".into()), DcpPathPart::Index(0)]
        );
        assert_eq!(
            (doc.storage[1].offset.clone(), doc.storage[1].rank),
            (None, 1)
        );
        assert_eq!(DcpDocument::decode(Some(3), &doc.encode()?)?, doc);
        Ok(())
    }

    #[test]
    fn another_format_or_damage_is_corrupt() {
        let other = WRITTEN_BY_0_4_0.replacen(r#""format":1"#, r#""format":2"#, 1);
        for bytes in [other.as_bytes(), &WRITTEN_BY_0_4_0.as_bytes()[..40], b"[]"] {
            let e = DcpDocument::decode(Some(3), bytes).expect_err("refused");
            assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        }
    }
}
