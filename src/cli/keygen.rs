//! `kiln keygen --out NAME`: an approver's ed25519 key pair.

use super::*;
use crate::governance::keys;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Writes NAME.key (secret, mode 0600) and NAME.pub (public key).
    #[arg(long)]
    pub out: PathBuf,
    /// The approver's name, as the server's [[approvers]] lists it
    /// (default: the file name of --out).
    #[arg(long)]
    pub name: Option<String>,
    /// Overwrite existing files.
    #[arg(long)]
    pub force: bool,
}

fn with_ext(p: &Path, ext: &str) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(ext);
    PathBuf::from(s)
}

fn write_secret(path: &Path, text: &str, force: bool) -> std::io::Result<()> {
    use std::io::Write;
    let mut o = std::fs::OpenOptions::new();
    o.write(true);
    if force {
        o.create(true).truncate(true);
    } else {
        o.create_new(true);
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    let mut f = o.open(path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    f.write_all(text.as_bytes())
}

pub fn run(a: Args) -> i32 {
    let name = match a.name.clone().or_else(|| {
        a.out
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_string)
    }) {
        Some(n) if !n.trim().is_empty() => n,
        _ => return usage_error("--out needs a file name (or pass --name)"),
    };
    let key = match keys::generate() {
        Ok(k) => k,
        Err(e) => {
            eprintln!("{:?}", miette::Report::new(e));
            return EXIT_USAGE;
        }
    };
    let secret = with_ext(&a.out, ".key");
    let public = with_ext(&a.out, ".pub");
    if let Err(e) = write_secret(&secret, &keys::key_file(&name, &key), a.force) {
        return usage_error(&format!(
            "cannot write {}: {e}{}",
            secret.display(),
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                " (pass --force to overwrite)"
            } else {
                ""
            }
        ));
    }
    let pubhex = keys::public_hex(&key.verifying_key());
    if let Err(e) = std::fs::write(&public, format!("{pubhex}\n")) {
        return usage_error(&format!("cannot write {}: {e}", public.display()));
    }
    eprintln!(
        "wrote {} (secret, keep it private) and {}",
        secret.display(),
        public.display()
    );
    eprintln!("add to the gateway's kiln.toml:");
    eprintln!();
    eprintln!("[[approvers]]");
    eprintln!("name = {}", serde_json::Value::String(name));
    eprintln!("groups = [\"platform\"]");
    eprintln!("public_key = \"{pubhex}\"");
    println!("{pubhex}");
    EXIT_OK
}
