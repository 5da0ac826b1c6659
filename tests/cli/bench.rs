//! `ckpt bench` runs the comparison and prints a table of ratios.

use crate::common;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn bench_prints_a_ratio_table() -> Result {
    let dir = tempfile::tempdir()?;
    let (code, out, err) = common::ckpt(&[
        "bench",
        "--sizes",
        "small",
        "--dir",
        dir.path().to_str().ok_or("path")?,
    ])?;
    assert_eq!(code, 0, "{err}");
    for contender in [
        "ckptstore commit",
        "raw write + fsync",
        "seed JSON + fsync",
        "seed JSON (no fsync)",
    ] {
        assert!(
            out.contains(&format!("| small | {contender} |")),
            "{contender} missing:\n{out}"
        );
    }
    assert!(out.contains("1.00x"), "no ratio column:\n{out}");
    // It cleans up after itself.
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 0);
    let (code, _, err) = common::ckpt(&["bench", "--sizes", "huge"])?;
    assert_eq!(code, 1);
    assert!(err.contains("unknown size"), "{err}");
    Ok(())
}
