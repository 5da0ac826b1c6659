//! 1,000 commits under keep-last-3 keep the file bounded (at most 2x the
//! live data once space reuse settles), and `compact()` gives space back.

use crate::common;

use ckptstore::{GradientCheckpoint, Retention, StoreOptions};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn keep_last_3_bounds_the_file_and_compact_shrinks_it() -> Result {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bounded.ckpt");
    let store = StoreOptions::new()
        .retention(Retention::new().keep_last(3))
        .open(&path)?;
    let mut ckpt = GradientCheckpoint::new(common::graph(0)?, 0);
    let base = common::bytes(1, 1 << 20);
    let mut max_file = 0u64;
    let mut settled_file = 0u64;
    let mut max_allocated = 0u64;
    let mut live = 0u64;
    for step in 0..1_000u64 {
        ckpt.step = step;
        // Two 1 MiB blobs that change every step.
        for (i, name) in ["adam_m", "adam_v"].iter().enumerate() {
            let mut blob = base.clone();
            blob[..16].copy_from_slice(&[step.to_le_bytes(), (i as u64).to_le_bytes()].concat());
            ckpt.set_optimizer_state(*name, blob);
        }
        store.commit(&ckpt)?;
        let file = std::fs::metadata(&path)?.len();
        if step >= 100 {
            let stats = store.stats()?;
            if step == 100 {
                settled_file = file;
            }
            max_file = max_file.max(file);
            max_allocated = max_allocated.max(stats.allocated_bytes);
            live = stats.stored_bytes;
        }
    }
    assert_eq!(store.steps()?, vec![997, 998, 999]);
    // Six 1 MiB blobs live; their identical 128-byte tails are one chunk.
    assert_eq!(live, 6 * ((1 << 20) - 128) + 128);
    println!(
        "live {live} B; after warm-up: largest allocation {max_allocated} B ({:.2}x), \
         largest file {max_file} B ({:.2}x)",
        max_allocated as f64 / live as f64,
        max_file as f64 / live as f64
    );
    // Bounded: the file stopped growing once space reuse settled...
    assert_eq!(
        max_file, settled_file,
        "the file kept growing after step 100"
    );
    // ...and redb's allocation stays within 2x the live data. (The file
    // itself grows in redb's large region steps and may stand above that.)
    assert!(
        max_allocated <= 2 * live,
        "{max_allocated} B allocated for {live} B live"
    );
    assert!(
        max_file <= 3 * live,
        "file grew to {max_file} B for {live} B of live data"
    );

    // Drop to one step and compact: the file shrinks.
    store.apply_retention(&Retention::new().keep_last(1))?;
    let before = std::fs::metadata(&path)?.len();
    store.compact()?;
    let after = std::fs::metadata(&path)?.len();
    println!("compact: {before} -> {after} B");
    assert!(
        after < before,
        "compact did not shrink the file ({before} -> {after})"
    );
    assert_eq!(store.get(999)?.as_ref(), Some(&ckpt));
    assert!(store.verify()?.is_ok());
    Ok(())
}
