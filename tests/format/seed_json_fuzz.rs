//! The seed JSON importer never panics, on arbitrary bytes or on mutations
//! of a real checkpoint file, and what it accepts round-trips.

use ckptstore::GradientCheckpoint;
use proptest::prelude::*;

const FIXTURE: &str = include_str!("../fixtures/seed_step42.json");

fn cases() -> u32 {
    if std::env::var_os("CKPT_LONG").is_some() {
        50_000
    } else {
        2_000
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn arbitrary_bytes_do_not_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = GradientCheckpoint::from_json(&bytes);
    }

    #[test]
    fn mutated_files_load_or_fail_cleanly(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)
    ) {
        let mut bytes = FIXTURE.as_bytes().to_vec();
        for (at, b) in edits {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        if let Ok(ckpt) = GradientCheckpoint::from_json(&bytes) {
            // Whatever loads saves and loads back the same.
            let again = serde_json::to_vec_pretty(&ckpt).expect("serializes");
            let back = GradientCheckpoint::from_json(&again).expect("round trip");
            prop_assert_eq!(back, ckpt);
        }
    }
}
