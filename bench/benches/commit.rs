//! Criterion: ckptstore commit and latest() against raw write+fsync of the
//! same bytes, small and medium checkpoints (the large one and the other
//! contenders are in `compare`).

mod common;

use std::time::Duration;

use common::*;
use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};

fn commit(c: &mut Criterion) {
    let mut group = c.benchmark_group("commit");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(8));
    for w in [SMALL, MEDIUM] {
        group.throughput(Throughput::Bytes(w.logical_bytes()));
        let mut ckpt = checkpoint(&w);
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir");

        let mut store = Store::new(dir.path().join("bench.ckpt")).expect("open store");
        let mut step = 0u64;
        group.bench_function(BenchmarkId::new("ckptstore", w.name), |b| {
            b.iter(|| {
                step += 1;
                touch(&mut ckpt, step);
                store.commit(&ckpt).expect("commit");
            })
        });
        group.bench_function(BenchmarkId::new("ckptstore latest()", w.name), |b| {
            b.iter(|| store.read_latest().expect("latest"))
        });

        let raw_dir = dir.path().join("raw");
        std::fs::create_dir(&raw_dir).expect("raw dir");
        let mut raw = RawFsync::new(raw_dir);
        group.bench_function(BenchmarkId::new("raw write+fsync", w.name), |b| {
            b.iter(|| {
                step += 1;
                touch(&mut ckpt, step);
                raw.commit(&ckpt).expect("raw write");
            })
        });
        group.bench_function(BenchmarkId::new("raw read", w.name), |b| {
            b.iter(|| raw.read_latest().expect("raw read"))
        });
    }
    group.finish();
}

#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::commit);
}
use group::benches;
criterion_main!(benches);
