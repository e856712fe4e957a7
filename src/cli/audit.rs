//! `kiln audit verify FILE`: check the hash chain of an audit log.

use super::*;
use crate::governance::audit;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub command: AuditCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum AuditCommand {
    /// Verify every entry's hash and link, and that the log holds the head
    /// its `FILE.head` file recorded; print the head hash (exit 0), or name
    /// the first line that does not verify (exit 1).
    Verify {
        file: PathBuf,
        /// The head hash expected (from `kiln status`): also catches
        /// entries removed from the end.
        #[arg(long)]
        head: Option<String>,
    },
}

pub fn run(a: Args) -> i32 {
    match a.command {
        AuditCommand::Verify { file, head } => {
            let checked = if head.is_some() {
                audit::verify_file(&file).map(|v| (v, false))
            } else {
                audit::verify_file_and_head(&file)
            };
            let (v, with_head) = match checked {
                Ok(v) => v,
                Err(e @ audit::AuditError::Io { .. }) => {
                    eprintln!("{:?}", miette::Report::new(e));
                    return EXIT_USAGE;
                }
                Err(e) => {
                    eprintln!("{:?}", miette::Report::new(e));
                    return EXIT_FINDINGS;
                }
            };
            if let Some(h) = head {
                let h = h.trim().to_ascii_lowercase();
                if h != v.head {
                    let e = audit::AuditError::Head {
                        expected: h,
                        found: v.head.clone(),
                    };
                    eprintln!("{:?}", miette::Report::new(e));
                    return EXIT_FINDINGS;
                }
            }
            let note = if with_head {
                ", and it holds the head its .head file recorded"
            } else {
                ""
            };
            eprintln!(
                "{}: {} entries, chain intact{note}",
                file.display(),
                v.entries
            );
            println!("{}", v.head);
            EXIT_OK
        }
    }
}
