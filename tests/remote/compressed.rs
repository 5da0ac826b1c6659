//! Bucket format 4 (issue 67): with `Remote::with_compression`, chunks
//! go into packs compressed where that saves bytes, named by their raw
//! bytes' hash as before. Every dtype and shape round-trips through a
//! push, a pull and shards (whole and ranged reads, over the file system
//! and over the object store); an unchanged step uploads nothing; a
//! flipped byte in a compressed chunk is damage that reads and `verify`
//! report; without compression a step stays format 3. The fixture
//! `tests/fixtures/bucket-format4` (written by
//! `write_the_format4_fixture`, ignored: `CKPT_WRITE_FIXTURE=$PWD/tests/fixtures/bucket-format4
//! cargo test --test remote compressed::write -- --ignored`) is the
//! format's contract: every later build reads it as it was written.

use std::sync::Arc;

use ckptstore::{
    CheckpointStore, ComputationGraphStore, Dtype, Entry, GradientCheckpoint, Remote, Step, Tensor,
};
use object_store::memory::InMemory;

use super::Result;
use crate::common::{bytes, ckpt};

/// bf16 near zero: a few exponent bytes, noisy mantissas (as trained
/// weights are), `n` elements.
fn weights(seed: u64, n: usize) -> Vec<u8> {
    let noise = bytes(seed, n);
    noise
        .iter()
        .enumerate()
        .flat_map(|(i, &m)| [m, 0x3c + u8::from(i % 3 == 0)])
        .collect()
}

/// A step of every dtype and shape a bucket holds: tensors that compress
/// (bf16 weights over several chunks and an odd end, f32 small values),
/// one that does not (random bytes), empty and 0-dim tensors, a tensor
/// under 64 KiB (in the packed chunk), plain blobs; only "rng" differs
/// from step to step.
pub(super) fn state(step: u64) -> Result<GradientCheckpoint> {
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    c.set_tensor(
        "w",
        Tensor::new(Dtype::BF16, vec![1_100, 1_001], weights(1, 1_100 * 1_001))?,
    );
    let small: Vec<u8> = (0..600_001u32)
        .flat_map(|i| (f32::from(u16::try_from(i % 1000).unwrap_or(0)) * 1e-3).to_le_bytes())
        .collect();
    c.set_tensor("m", Tensor::new(Dtype::F32, vec![600_001], small)?);
    c.set_tensor(
        "noise",
        Tensor::new(Dtype::U8, vec![1_500_000], bytes(9, 1_500_000))?,
    );
    c.set_tensor("empty", Tensor::new(Dtype::F32, vec![0, 3], Vec::new())?);
    c.set_tensor(
        "scalar",
        Tensor::new(Dtype::F64, vec![], 2.5f64.to_le_bytes().to_vec())?,
    );
    c.set_tensor(
        "head",
        Tensor::new(Dtype::BF16, vec![777], weights(2, 777))?,
    );
    c.set_optimizer_state("rng", bytes(step, 100));
    c.set_optimizer_state("zeros", vec![0; 2 << 20]);
    Ok(c)
}

/// The bytes of every file under `dir`.
fn stored_bytes(dir: &std::path::Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        total += if entry.file_type()?.is_dir() {
            stored_bytes(&entry.path())?
        } else {
            entry.metadata()?.len()
        };
    }
    Ok(total)
}

/// The `"format"` of every step manifest under `bucket`.
pub(super) fn manifest_formats(bucket: &std::path::Path) -> Result<Vec<u64>> {
    let mut formats = Vec::new();
    for entry in std::fs::read_dir(bucket.join("manifests"))? {
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(entry?.path())?)?;
        formats.push(json["format"].as_u64().ok_or("no format")?);
    }
    Ok(formats)
}

#[test]
fn a_compressed_push_round_trips_every_dtype_and_shape_in_fewer_bytes() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    store.commit(&state(1)?)?;
    let logical = state(1)?.logical_bytes();
    let (on, off) = (dir.path().join("on"), dir.path().join("off"));
    let remote = Remote::open(&format!("file://{}", on.display()))?.with_compression(true);
    let pushed = remote.push(&store)?;
    // Raw: the same push without compression, format 3.
    let plain = Remote::open(&format!("file://{}", off.display()))?;
    let raw = plain.push(&store)?;
    assert_eq!(manifest_formats(&off)?, vec![3]);
    assert_eq!(manifest_formats(&on)?, vec![4]);
    assert!(
        pushed.bytes_uploaded * 10 < raw.bytes_uploaded * 8,
        "{pushed:?} against {raw:?}"
    );
    let (packs_on, packs_off) = (
        stored_bytes(&on.join("packs"))?,
        stored_bytes(&off.join("packs"))?,
    );
    assert_eq!(
        (packs_on, packs_off),
        (pushed.bytes_uploaded, raw.bytes_uploaded)
    );
    // Raw, the state's bytes but for its second MiB of zeros (one chunk
    // twice).
    assert!(
        raw.bytes_uploaded + (1 << 20) + (64 << 10) >= logical,
        "{raw:?} of {logical}"
    );
    // Read back bit for bit, by a remote that compresses or not.
    let want = store.get(1)?;
    assert!(remote.get(1)? == want);
    let reader = Remote::open(&format!("file://{}", on.display()))?;
    assert!(reader.get(1)? == want);
    let fresh = CheckpointStore::open(dir.path().join("copy.ckpt"))?;
    reader.pull(1, &fresh)?;
    assert!(fresh.get(1)? == want);
    let verified = reader.verify()?;
    assert!(
        verified.damaged.is_empty() && verified.steps_ok == 1,
        "{verified:?}"
    );
    // An unchanged step uploads nothing; a changed one only its chunks.
    let again = remote.push(&store)?;
    assert_eq!((again.steps_present, again.bytes_uploaded), (1, 0));
    store.commit(&state(2)?)?;
    let second = remote.push(&store)?;
    assert!(second.bytes_uploaded < 200 << 10, "{second:?}");
    assert!(remote.get(2)? == store.get(2)?);
    Ok(())
}

/// The shards of one step, compressed: each rank's tensors, read whole
/// and in ranges that start and end inside compressed chunks.
fn shards_round_trip(remote: &Remote) -> Result {
    let world = 2;
    let shard = |rank: u32| -> Result<Step> {
        let mut c = state(4)?.into_step();
        c.insert("rng", Entry::Blob(bytes(u64::from(rank), 100)));
        Ok(c)
    };
    let (mut names, mut uploaded) = (Vec::new(), Vec::new());
    for rank in 0..world {
        uploaded.push(shard(rank)?);
        let info = remote.upload_shard(4, rank, world, &uploaded[rank as usize])?;
        assert!(
            info.bytes_uploaded > 0 && info.bytes_uploaded < 4 << 20,
            "{info:?}"
        );
        names.push(info.shard);
    }
    remote.commit_global(4, &names)?;
    let global = remote.open_global(4)?.ok_or("no step 4")?;
    let w = weights(1, 1_100 * 1_001);
    let noise = bytes(9, 1_500_000);
    let pieces = [
        (0, "w", 0, w.len() as u64),
        (1, "w", 1_000_000, 300_000),
        (1, "w", (1 << 20) - 200, 400),
        (1, "noise", 5, 1_048_000),
        (0, "scalar", 0, 8),
        (0, "head", 10, 100),
    ];
    let read = remote.read_pieces(&global, &pieces)?;
    assert!(read[0] == w);
    assert!(read[1] == w[1_000_000..1_300_000]);
    assert!(read[2] == w[(1 << 20) - 200..(1 << 20) + 200]);
    assert!(read[3] == noise[5..1_048_005]);
    assert_eq!(read[4], 2.5f64.to_le_bytes());
    assert!(read[5] == weights(2, 777)[10..110]);
    let mut into = vec![0u8; 300_000];
    remote.read_pieces_into(&global, &pieces[1..2], &mut [&mut into[..]])?;
    assert!(into == read[1]);
    assert!(remote.get_shard(4, 1)?.as_ref() == Some(&uploaded[1]));
    // The same tensors again upload nothing but the small values.
    let again = remote.upload_shard(5, 0, 1, &state(5)?.into_step())?;
    assert!(again.bytes_uploaded < 8 << 10, "{again:?}");
    Ok(())
}

#[test]
fn compressed_shards_read_whole_and_in_ranges_from_a_directory() -> Result {
    let dir = tempfile::tempdir()?;
    let url = format!("file://{}/bucket", dir.path().display());
    shards_round_trip(&Remote::open(&url)?.with_compression(true))
}

#[test]
fn compressed_shards_read_whole_and_in_ranges_from_an_object_store() -> Result {
    let memory = Arc::new(InMemory::new());
    let remote = Remote::with_store(memory, "p", "mem://compressed")?.with_compression(true);
    shards_round_trip(&remote)
}

#[test]
fn a_flipped_byte_in_a_compressed_chunk_is_damage_never_a_panic() -> Result {
    let dir = tempfile::tempdir()?;
    let store = CheckpointStore::open(dir.path().join("run.ckpt"))?;
    store.commit(&state(1)?)?;
    let bucket = dir.path().join("bucket");
    let remote = Remote::open(&format!("file://{}", bucket.display()))?.with_compression(true);
    remote.push(&store)?;
    // The one pack (under 64 MiB): flip a byte early on, inside the first
    // chunk, which is compressed (bf16 weights).
    let pack = std::fs::read_dir(bucket.join("packs"))?
        .next()
        .ok_or("no pack")??
        .path();
    let mut data = std::fs::read(&pack)?;
    for at in [100, 5_000, 20_000] {
        data[at] ^= 0x21;
        std::fs::write(&pack, &data)?;
        let reader = Remote::open(&format!("file://{}", bucket.display()))?;
        let e = reader.get(1).expect_err("damaged");
        assert!(e.to_string().contains("hash check"), "{e}");
        let verified = reader.verify()?;
        assert_eq!(verified.damaged.len(), 1, "{verified:?}");
        data[at] ^= 0x21;
    }
    std::fs::write(&pack, &data)?;
    assert!(Remote::open(&format!("file://{}", bucket.display()))?.get(1)? == store.get(1)?);
    Ok(())
}

const FIXTURE: &str = "tests/fixtures/bucket-format4";

/// The fixture's pushed step 1, and rank `rank`'s shard of its global
/// step 2 (fixed timestamps: the same steps whenever they are made).
fn fixture_step(step: u64, rank: u64) -> Result<GradientCheckpoint> {
    let mut c = GradientCheckpoint::new(ComputationGraphStore::new(), step);
    c.timestamp = 1_800_000_000 + step;
    c.set_tensor(
        "w",
        Tensor::new(Dtype::BF16, vec![300, 401], weights(rank + 3, 300 * 401))?,
    );
    c.set_tensor(
        "noise",
        Tensor::new(Dtype::U8, vec![70_000], bytes(rank + 4, 70_000))?,
    );
    c.set_tensor(
        "scalar",
        Tensor::new(Dtype::F32, vec![], 1.5f32.to_le_bytes().to_vec())?,
    );
    c.set_optimizer_state("rng", bytes(rank, 40));
    Ok(c)
}

#[test]
#[ignore = "writes the fixture: run by hand (see the module's comment)"]
fn write_the_format4_fixture() -> Result {
    let out = std::env::var("CKPT_WRITE_FIXTURE")?;
    let work = tempfile::tempdir()?;
    let store = CheckpointStore::open(work.path().join("run.ckpt"))?;
    store.commit(&fixture_step(1, 0)?)?;
    let remote = Remote::open(&format!("file://{out}"))?.with_compression(true);
    remote.push(&store)?;
    let names = (0..2)
        .map(|rank| {
            Ok(remote
                .upload_shard(2, rank, 2, &fixture_step(2, rank.into())?.into_step())?
                .shard)
        })
        .collect::<Result<Vec<_>>>()?;
    remote.commit_global(2, &names)?;
    Ok(())
}

#[test]
fn a_format4_bucket_still_reads() -> Result {
    let dir = tempfile::tempdir()?;
    let bucket = dir.path().join("bucket");
    super::promise::copy_dir(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE),
        &bucket,
    )?;
    assert_eq!(
        manifest_formats(&bucket)?
            .iter()
            .filter(|&&f| f == 4)
            .count(),
        1
    );
    let remote = Remote::open(&format!("file://{}", bucket.display()))?;
    assert_eq!(remote.steps()?, vec![1, 2]);
    assert!(remote.get(1)? == Some(fixture_step(1, 0)?));
    for rank in 0..2 {
        assert!(
            remote.get_shard(2, rank)? == Some(fixture_step(2, rank.into())?.into_step()),
            "rank {rank}"
        );
    }
    let global = remote.open_global(2)?.ok_or("no step 2")?;
    let w = weights(4, 300 * 401);
    assert!(remote.read_pieces(&global, &[(1, "w", 1_001, 50_000)])?[0] == w[1_001..51_001]);
    let verified = remote.verify()?;
    assert!(verified.is_ok() && verified.steps_ok == 2, "{verified:?}");
    Ok(())
}

/// A store at `dir/run.ckpt` holding `state(1)`: its path.
fn store_of_step_1(dir: &std::path::Path) -> Result<std::path::PathBuf> {
    let path = dir.join("run.ckpt");
    CheckpointStore::open(&path)?.commit(&state(1)?)?;
    Ok(path)
}

/// `ckpt stats URL --json`: the bucket's steps, chunk bytes (each chunk
/// once) and stored bytes.
fn stats(url: &str) -> Result<(u64, u64, u64)> {
    let (code, out, err) = ckpt(&["stats", url, "--json"])?;
    assert_eq!(code, 0, "{err}");
    let totals: serde_json::Value = serde_json::from_str(&out)?;
    let field = |name: &str| totals[name].as_u64().ok_or(format!("no {name}: {out}"));
    Ok((
        field("steps")?,
        field("chunk_bytes")?,
        field("stored_bytes")?,
    ))
}

#[test]
fn ckpt_push_compress_writes_format_4_that_any_command_reads() -> Result {
    let dir = tempfile::tempdir()?;
    let store = store_of_step_1(dir.path())?;
    let bucket = dir.path().join("bucket");
    let url = format!("file://{}", bucket.display());
    let run = |args: &[&str]| -> Result<(i32, String)> {
        let (code, out, _) = ckpt(args)?;
        Ok((code, out))
    };
    let (code, said) = run(&["push", &store.to_string_lossy(), &url, "--compress"])?;
    assert_eq!(code, 0, "{said}");
    assert!(said.contains(" compressed) in "), "{said}");
    assert_eq!(manifest_formats(&bucket)?, vec![4]);
    let (code, said) = run(&["verify", &url])?;
    assert_eq!(code, 0, "{said}");
    // Stored against logical bytes: the bucket's totals, and the step's.
    let (steps, chunks, stored) = stats(&url)?;
    assert!(stored * 10 < chunks * 8 && steps == 1, "{chunks} {stored}");
    let packs = stored_bytes(&bucket.join("packs"))?;
    assert_eq!(stored, packs);
    let (code, said) = run(&["show", &url, "1"])?;
    assert!(
        code == 0 && said.contains("as stored, compressed"),
        "{said}"
    );
    let copy = dir.path().join("copy.ckpt");
    let (code, said) = run(&["pull", &url, &copy.to_string_lossy(), "--step", "1"])?;
    assert_eq!(code, 0, "{said}");
    assert!(CheckpointStore::open(&copy)?.get(1)? == CheckpointStore::open(&store)?.get(1)?);
    Ok(())
}

/// Dedup never points at lost bytes with compression either: a job that
/// loaded a compressed step, whose packs are then deleted, cut short or
/// replaced, uploads their chunks again (compressed) and its next step
/// loads.
#[test]
fn a_compressed_save_after_its_packs_were_lost_uploads_their_chunks_again() -> Result {
    use super::lost_packs::{lose, Loss};
    for loss in [Loss::Deleted, Loss::Truncated, Loss::Replaced] {
        let memory = Arc::new(InMemory::new());
        let open = || -> Result<Remote> {
            Ok(Remote::with_store(memory.clone(), "run", "mem://run")?.with_compression(true))
        };
        let first = open()?;
        let saved = state(1)?.into_step();
        let info = first.upload_shard(1, 0, 1, &saved)?;
        first.commit_global(1, &[info.shard])?;
        let job = open()?;
        let global = job.open_global(1)?.ok_or("no step 1")?;
        job.read_pieces(&global, &[(0, "w", 0, 1_100 * 1_001 * 2)])?;
        lose(&memory, "run", loss)?;
        let next = state(2)?.into_step();
        let info = job.upload_shard(2, 0, 1, &next)?;
        job.commit_global(2, &[info.shard])?;
        assert!(info.bytes_uploaded > 2 << 20, "{loss:?}: {info:?}");
        assert!(open()?.get_shard(2, 0)? == Some(next), "{loss:?}");
        assert!(
            open()?.verify()?.damaged.len() == 1,
            "{loss:?}: step 1 lost its packs"
        );
    }
    Ok(())
}

/// Compression is on by default where bytes cross a network (`s3://`),
/// off for a directory and a store given to `with_store`; `ckpt push`
/// follows the default, `--compress` and `--no-compress` override it.
#[test]
fn compression_is_the_default_for_s3_and_not_for_a_directory() -> Result {
    let dir = tempfile::tempdir()?;
    let file = format!("file://{}", dir.path().join("bucket").display());
    assert!(Remote::open("s3://some-bucket/run")?.compression());
    assert!(!Remote::open(&file)?.compression());
    let memory = Arc::new(InMemory::new());
    assert!(!Remote::with_store(memory, "run", "memory://run")?.compression());
    let path = store_of_step_1(dir.path())?;
    let push = |url: &str, flags: &[&str]| -> Result<(i32, String)> {
        let (code, out, err) = ckpt(&[&["push", &path.to_string_lossy(), url], flags].concat())?;
        Ok((code, out + &err))
    };
    let (code, said) = push(&file, &[])?;
    assert!(code == 0 && !said.contains("compressed"), "{said}");
    assert_eq!(manifest_formats(&dir.path().join("bucket"))?, vec![3]);
    let (code, said) = push(&file, &["--compress", "--no-compress"])?;
    assert_eq!(code, 2, "{said}");
    let Ok(bucket) = std::env::var("CKPT_TEST_BUCKET") else {
        eprintln!("compression_is_the_default_for_s3: the s3:// half skipped: no S3 server");
        return Ok(());
    };
    let _server = super::garage::SERVER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for (flags, compressed) in [(&[][..], true), (&["--no-compress"][..], false)] {
        let url = format!("s3://{bucket}/{}", super::garage::fresh_prefix());
        let (code, said) = push(&url, flags)?;
        assert!(
            code == 0 && said.contains(" compressed) in ") == compressed,
            "{said}"
        );
        let (_, chunks, stored) = stats(&url)?;
        assert_eq!(stored * 10 < chunks * 8, compressed, "{chunks} {stored}");
    }
    Ok(())
}
