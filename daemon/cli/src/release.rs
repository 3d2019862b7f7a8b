//! `weightstream release`: gives back one of this uid's references to a model. A reference is
//! the uid's, not the connection's: a model that `weightstream load` loaded stays after the
//! command exits, until its uid releases it; the model leaves the store once no uid holds a
//! reference and no session uses it.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use weightstream_client::Client;

use super::CliResult;

#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    /// The model's id, as `weightstream load` and `weightstream status` print it.
    model_id: String,
}

pub async fn run(socket: Option<PathBuf>, args: ReleaseArgs) -> CliResult {
    let mut client = Client::connect(socket.as_deref()).await?;
    let left = client.release_model(&args.model_id).await?;
    let fate = if left == 0 {
        "no references left: it leaves the store once no session uses it"
    } else {
        "other references keep it"
    };
    println!(
        "{}  released  (references left: {left}; {fate})",
        args.model_id
    );
    Ok(())
}
