//! `ckpt export`: a stored step as safetensors or JSON, or a step of a
//! store or a bucket as a Hugging Face checkpoint directory (`--hf`).

use std::path::Path;
use std::process::ExitCode;

use ckptstore::Error;

use super::args::{Format, HfOptions};
use super::{open_read, output, remote, resolve, spinner, Result};

pub(crate) fn export(store: &Path, step: &str, output: &Path, format: Format) -> Result<ExitCode> {
    let s = open_read(store)?;
    let step = resolve(&s, step)?;
    let bar = spinner(format!("exporting step {step}"));
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            return Err(format!(
                "cannot export to {}: directory {} does not exist (create it first, or pick \
                 another --output)",
                output.display(),
                dir.display()
            )
            .into());
        }
    }
    match format {
        Format::Safetensors => s.export_safetensors(step, output)?,
        Format::Json => s
            .get(step)?
            .ok_or(Error::StepNotFound { step })?
            .save(output)?,
    }
    bar.finish_and_clear();
    println!("exported step {step} to {}", output.display());
    Ok(ExitCode::SUCCESS)
}

/// `ckpt export STORE|URL STEP --hf -o DIR`.
pub(crate) fn export_hf(
    store: &str,
    step: &str,
    dir: &Path,
    o: &HfOptions<'_>,
) -> Result<ExitCode> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let (step, written) = if remote::is_url(store) {
        remote::export_hf(store, step, dir, o)?
    } else {
        let s = open_read(Path::new(store))?;
        let step = resolve(&s, step)?;
        (
            step,
            s.export_hf(step, dir, o.max_shard, o.prefix, o.dtype)?,
        )
    };
    println!(
        "step {step}: {} tensors ({}) in {} shards written to {}",
        written.weight_map.len(),
        output::bytes(written.total_size),
        written.shards.len(),
        dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
