//! (d) SQLite, for the benches only (rusqlite is a dev-dependency).

use std::fs;
use std::path::PathBuf;

use ckptstore::GradientCheckpoint;

use crate::common::{Contender, Result};

/// (d) SQLite: a blob row per parameter, WAL, synchronous=FULL.
pub struct Sqlite {
    pub path: PathBuf,
    conn: rusqlite::Connection,
    last: Option<u64>,
}

impl Sqlite {
    pub fn new(path: PathBuf) -> Result<Self> {
        let conn = rusqlite::Connection::open(&path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.execute_batch(
            "CREATE TABLE steps (step INTEGER PRIMARY KEY, meta TEXT NOT NULL);
             CREATE TABLE blobs (step INTEGER NOT NULL, name TEXT NOT NULL, data BLOB NOT NULL,
                                 PRIMARY KEY (step, name));",
        )?;
        Ok(Sqlite {
            path,
            conn,
            last: None,
        })
    }
}

impl Contender for Sqlite {
    fn name(&self) -> &'static str {
        "SQLite (WAL, FULL)"
    }
    fn commit(&mut self, ckpt: &GradientCheckpoint) -> Result {
        let txn = self.conn.transaction()?;
        txn.execute(
            "INSERT INTO steps (step, meta) VALUES (?1, ?2)",
            rusqlite::params![ckpt.step as i64, serde_json::to_string(&ckpt.graph)?],
        )?;
        {
            let mut stmt =
                txn.prepare("INSERT INTO blobs (step, name, data) VALUES (?1, ?2, ?3)")?;
            for (name, data) in &ckpt.optimizer_state {
                stmt.execute(rusqlite::params![ckpt.step as i64, name, data])?;
            }
        }
        txn.commit()?;
        self.last = Some(ckpt.step);
        Ok(())
    }
    fn read_latest(&mut self) -> Result<u64> {
        let step = self.last.ok_or("nothing saved")?;
        let mut stmt = self
            .conn
            .prepare("SELECT data FROM blobs WHERE step = ?1")?;
        let mut rows = stmt.query([step as i64])?;
        let mut total = 0u64;
        while let Some(row) = rows.next()? {
            let data: Vec<u8> = row.get(0)?;
            total += data.len() as u64;
        }
        Ok(total)
    }
    fn disk_bytes(&self) -> Result<u64> {
        let mut total = super::allocated(&fs::metadata(&self.path)?);
        for ext in ["-wal", "-shm"] {
            let mut p = self.path.clone().into_os_string();
            p.push(ext);
            if let Ok(m) = fs::metadata(&p) {
                total += super::allocated(&m);
            }
        }
        Ok(total)
    }
}
