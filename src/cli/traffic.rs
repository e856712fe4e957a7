//! `kiln traffic`

use super::*;

#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_a: Args) -> i32 {
    EXIT_OK
}
