//! A real PostgreSQL server for the fleet batch tests: its own cluster
//! (`initdb`) in a temporary directory, on a free loopback port, trust
//! authentication, stopped (`pg_ctl stop -m immediate`) and removed when
//! dropped. Debian installs the binaries under `/usr/lib/postgresql/N/bin`
//! (not on `PATH`); they are looked for there too. As root (CI containers)
//! the server runs as the `postgres` user (`runuser`), since PostgreSQL
//! refuses to run as root. Where the binaries are missing, [`Postgres::start`]
//! says so and the test returns (skipped); `.ci/run` installs them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

pub struct Postgres {
    dir: PathBuf,
    bin: PathBuf,
    user: Option<&'static str>,
    pub port: u16,
}

/// The directory holding `initdb` and `pg_ctl`.
fn bin_dir() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            if d.join("initdb").is_file() && d.join("pg_ctl").is_file() {
                return Some(d);
            }
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin"))
        .filter(|d| d.join("initdb").is_file())
        .collect();
    found.sort();
    found.pop()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl Postgres {
    /// `None` (after saying so) where PostgreSQL is not installed.
    pub fn start() -> Option<Postgres> {
        let Some(bin) = bin_dir() else {
            eprintln!("SKIPPED: PostgreSQL is not installed (no initdb on PATH or under /usr/lib/postgresql); `.ci/run` installs it (apt-get install postgresql)");
            return None;
        };
        let user = if is_root() { Some("postgres") } else { None };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!("kiln-pg-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        if let Some(u) = user {
            let ok = Command::new("chown")
                .arg(format!("{u}:"))
                .arg(&dir)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            assert!(ok, "cannot chown {} to {u}", dir.display());
        }
        let port = super::redis::free_port();
        let pg = Postgres {
            dir,
            bin,
            user,
            port,
        };
        let data = pg.dir.join("data");
        let out = pg
            .cmd("initdb")
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                "kiln",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50",
            pg.dir.display()
        );
        let out = pg
            .cmd("pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(pg.dir.join("log"))
            .args(["-o", &opts, "-w", "-t", "30", "start"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(pg.dir.join("log")).unwrap_or_default()
        );
        Some(pg)
    }

    fn cmd(&self, tool: &str) -> Command {
        let exe = self.bin.join(tool);
        let mut c = match self.user {
            Some(u) => {
                let mut c = Command::new("runuser");
                c.args(["-u", u, "--"]).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        c.current_dir(Path::new("/")).stdin(Stdio::null());
        c
    }

    /// The server's URL, as `[batch] store` takes it.
    pub fn url(&self) -> String {
        format!("postgres://kiln@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self
            .cmd("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
