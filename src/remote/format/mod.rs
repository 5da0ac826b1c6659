//! The bucket format: hashes as its objects hold them (`hash`), object
//! names and the small objects' serde types
//! (`layout`), a step's manifest and its format (`manifest`), bucket format 3's pack
//! names and index (`pack_format`), a chunk's stored form in a pack
//! (`stored`, format 4's compression), what a manifest needs and where its
//! chunks lie (`objects`), and the checks every object read passes before
//! it is relied on (`checks`).

pub(crate) mod checks;
pub(crate) mod hash;
pub(crate) mod layout;
pub(crate) mod manifest;
pub(crate) mod objects;
pub(crate) mod pack_format;
pub(crate) mod stored;
