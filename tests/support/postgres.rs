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
use std::time::Duration;

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
        Postgres::start_with(None)
    }

    /// With TLS: the server presents `tls` (certificate and key PEM files)
    /// and accepts TCP connections over TLS only (`hostssl` in
    /// `pg_hba.conf`): a plain connection is refused.
    pub fn start_tls(cert: &Path, key: &Path) -> Option<Postgres> {
        Postgres::start_with(Some((cert, key)))
    }

    fn start_with(tls: Option<(&Path, &Path)>) -> Option<Postgres> {
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
        let mut opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50",
            pg.dir.display()
        );
        if let Some((cert, key)) = tls {
            let (c, k) = (data.join("server.crt"), data.join("server.key"));
            std::fs::copy(cert, &c).unwrap();
            std::fs::copy(key, &k).unwrap();
            std::fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
            )
            .unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600)).unwrap();
            if let Some(u) = user {
                for f in [&c, &k, &data.join("pg_hba.conf")] {
                    let ok = Command::new("chown")
                        .arg(format!("{u}:"))
                        .arg(f)
                        .status()
                        .map(|s| s.success())
                        .unwrap_or(false);
                    assert!(ok, "cannot chown {}", f.display());
                }
            }
            opts.push_str(" -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key");
        }
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

/// A loopback TCP proxy in front of a server (PostgreSQL here) that a
/// test can cut or stall: [`Mode::Pass`] forwards both ways;
/// [`Mode::Stall`] keeps every connection open and accepts new ones but
/// forwards nothing (a hung server or network); [`Mode::Cut`] closes every
/// connection and closes new ones at once (a server that is down).
pub struct PgProxy {
    pub port: u16,
    mode: std::sync::Arc<std::sync::atomic::AtomicU8>,
    cut: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass = 0,
    Stall = 1,
    Cut = 2,
}

impl PgProxy {
    pub async fn start(server_port: u16) -> PgProxy {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mode = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(Mode::Pass as u8));
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let m = mode.clone();
        let cut_tx = cut.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                if m.load(Ordering::SeqCst) == Mode::Cut as u8 {
                    drop(client);
                    continue;
                }
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", server_port)).await
                else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                for (mut from, mut to) in [
                    (
                        Box::new(cr) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                        Box::new(sw) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
                    ),
                    (Box::new(sr), Box::new(cw)),
                ] {
                    let m = m.clone();
                    let mut cut_rx = cut_tx.subscribe();
                    cut_rx.mark_unchanged();
                    conns.spawn(async move {
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            // Stalled: nothing is read (the peer's writes
                            // pile up in the kernel's buffers).
                            while m.load(Ordering::SeqCst) == Mode::Stall as u8 {
                                tokio::select! {
                                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                                    _ = cut_rx.changed() => return,
                                }
                            }
                            let n = tokio::select! {
                                r = from.read(&mut buf) => match r {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => n,
                                },
                                _ = cut_rx.changed() => return,
                            };
                            while m.load(Ordering::SeqCst) == Mode::Stall as u8 {
                                tokio::select! {
                                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                                    _ = cut_rx.changed() => return,
                                }
                            }
                            if to.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
                while conns.try_join_next().is_some() {}
            }
        });
        PgProxy {
            port,
            mode,
            cut,
            task,
        }
    }

    /// The server's URL through the proxy, as `[batch] store` takes it.
    pub fn url(&self) -> String {
        format!("postgres://kiln@127.0.0.1:{}/postgres", self.port)
    }

    pub fn set(&self, mode: Mode) {
        self.mode
            .store(mode as u8, std::sync::atomic::Ordering::SeqCst);
        if mode == Mode::Cut {
            self.cut.send_modify(|g| *g += 1);
        }
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
