//! `weightstream release`: gives back one of this uid's references to a model, or, as root or
//! the daemon's user, every uid's (`--all`). A reference is the uid's, not the connection's: a
//! model that `weightstream load` loaded stays after the command exits (as a cache entry the
//! daemon evicts when it needs the memory, or pinned with `--pin`) until its uid releases it;
//! the model leaves the store once no uid holds a reference and no session uses it.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use weightstream_client::Client;

use super::{CliResult, Deadline, shown};

#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    /// The model's id, as `weightstream load` and `weightstream status` print it.
    model_id: String,
    /// Give back every uid's references, pins included (root and the daemon's user only):
    /// frees a model that others loaded; it goes once its sessions end.
    #[arg(long)]
    all: bool,
}

pub async fn run(socket: Option<PathBuf>, args: ReleaseArgs, deadline: Deadline) -> CliResult {
    let connect = Client::connect(socket.as_deref());
    let mut client = deadline.on("connecting", connect).await?;
    let id = shown(&args.model_id);
    if args.all {
        let release = client.release_model_for_all(&args.model_id);
        deadline.on("ReleaseModel", release).await?;
        out!("{id}  released for every uid  (it leaves the store once no session uses it)");
        return Ok(());
    }
    let left = (deadline.on("ReleaseModel", client.release_model(&args.model_id))).await?;
    let fate = if left == 0 {
        "no references left: it leaves the store once no session uses it"
    } else {
        "other references keep it"
    };
    out!("{id}  released  (references left: {left}; {fate})");
    Ok(())
}
